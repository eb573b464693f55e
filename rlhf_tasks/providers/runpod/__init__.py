"""RunPod provider: pods with Global Networking or Instant Clusters, through RunPod's REST API v2."""
