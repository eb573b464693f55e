#!/usr/bin/env python3
"""`ray` where the image has none yet (shipped in the ConfigMap, found last on PATH): KubeRay's
`wait-gcs-ready` init container runs `ray health-check --address HOST:PORT` in every worker's
image before `setup` could install Ray. This answers that one command (the head's GCS port
accepts a connection) and refuses every other, so a missing Ray is said, not hidden."""

import socket
import sys

args = sys.argv[1:]
if args[:1] == ["health-check"] and "--address" in args[:-1]:
    host, _, port = args[args.index("--address") + 1].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        sys.exit("ray health-check (rlhf-tasks' stand-in): the GCS at %s:%s does not answer: %s" % (host, port, exc))
    sys.exit(0)
sys.exit("ray: this image has no Ray (rlhf-tasks' stand-in answers only `ray health-check`); "
         "install Ray in the task's setup, or use an image that holds it")
