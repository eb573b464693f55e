"""The Kubernetes tests' infrastructure: a real control plane, the real KubeRay operator and a node runner (README.md)."""
