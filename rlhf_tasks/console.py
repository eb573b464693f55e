"""The launcher's voice: one timestamped line per message, for the launcher and the
providers alike (the node agents have their own, in the agent package)."""

from __future__ import annotations

import time


#: Called before each message: the launcher's progress line, drawn in place, wipes itself first.
before_say: list = []


def say(message: str) -> None:
    for wipe in list(before_say):
        wipe()
    print(f"[{time.strftime('%H:%M:%S')}] rlhf-tasks: {message}", flush=True)
