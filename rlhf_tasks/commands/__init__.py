"""The CLI's commands, one module per kind of command (rlhf_tasks/cli.py parses the arguments and maps
errors to exit codes): inspection.py and render.py need no cluster, cluster.py acts on a cluster
launched from here, job.py on one job through a cluster's dashboard; targets.py is what they act on."""
