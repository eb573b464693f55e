"""A machine that ends itself once its node agent is done, where the provider bills a machine
until someone ends it and its agent's end does not (a rented pod that stays up, billed, after
its container's command, and is restarted when its main process exits). The plan's `self_end` says
how, as data (an HTTP request whose URL and token come from the node's environment), so the
agent names no provider and no launcher needs to be attached. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Dict, Optional

from .protocol import http_request, log

#: The head waits this long after its result line before its machine ends, so that a launcher
#: following its log (a stream from the provider) reads the line first.
HEAD_LINGER_S = 10.0


def fill(template: str, env: Dict[str, str], defaults: Dict[str, str]) -> Optional[str]:
    """`template` with each `{VAR}` from `env` (or `defaults`); None when one is missing."""
    missing = []

    def value(match):
        name = match.group(1)
        found = env.get(name) or defaults.get(name)
        if not found:
            missing.append(name)
            return ""
        return found
    text = re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", value, template)
    return None if missing else text


def linger(seconds: float = HEAD_LINGER_S) -> bool:
    """Give a launcher that follows the head's log the time to read the result line and end the
    machine itself (its SIGTERM ends this process): whether it did, polled until `seconds` pass."""
    ended = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ended.append(signum))
    try:
        deadline = time.monotonic() + seconds
        while not ended and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return bool(ended)


def end_machine(rule: dict, head: bool = False, env: Optional[Dict[str, str]] = None) -> bool:
    """Send the plan's self_end request about this machine; whether it was taken. What it could
    not do is said in the log, never the token."""
    env = dict(os.environ) if env is None else env
    url = fill(rule["url"], env, rule.get("defaults") or {})
    token = env.get(rule["bearer_env"]) if rule.get("bearer_env") else None
    what = rule.get("what") or "end this machine"
    if url is None or (rule.get("bearer_env") and not token):
        needs = re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", rule["url"]) + ([rule["bearer_env"]] if rule.get(
            "bearer_env") else [])
        log("cannot %s: %s not set here; it stays up until it is ended from outside" % (
            what, ", ".join(n for n in needs if not (env.get(n) or (rule.get("defaults") or {}).get(n)))))
        return False
    if head:
        linger()
    log("the run is over here: %s" % what)
    headers = {"Authorization": "Bearer %s" % token} if token else {}
    try:
        status, body = http_request(url, rule["method"], rule.get("json_body"), headers, timeout=30.0)
    except OSError as exc:
        log("could not %s: %s" % (what, exc))
        return False
    if status >= 400:
        try:
            said = json.loads(body)
            said = "%s: %s" % (said.get("title"), said.get("detail"))
        except ValueError:
            said = body.decode("utf-8", "replace")[:300]
        log("could not %s: HTTP %d (%s)" % (what, status, said))
        return False
    return True
