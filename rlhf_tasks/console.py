"""The launcher's voice: one timestamped line per message, for the launcher and the
providers alike (the node agents have their own, in the agent package)."""

from __future__ import annotations

import time


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] rlhf-tasks: {message}", flush=True)
