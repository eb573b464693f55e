"""The Hugging Face Hub models of the plan (`plan["hub"]`), fetched before the head starts: on rank 0
into the cache every node sees, or on every node into its own where none is shared. The download is
huggingface_hub's own (`snapshot_download`: resumable, parallel, hf_transfer where that release uses
it), run as a subprocess of the node's Python, where the job's libraries are; the token comes from the
secret's variable, by name. Its progress comes back as lines the agent logs (the launcher shows them);
a model the hub does not know ends the head here, with the hub's words, before Ray starts. Once a model
is fetched, a marker beside it in the cache says so: a relaunch asks the hub nothing. Then Ray, the job
and the services run with HF_HUB_OFFLINE=1 (the plan's env), so no node asks the hub again; setup,
prepare and the fetch itself run online.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from .protocol import AgentError, log
from .raynode import console_script_python

OFFLINE_ENV = "HF_HUB_OFFLINE"
#: Beside a model's snapshots in the cache (models--ORG--NAME/): the commit the fetch completed.
MARKER = ".rlhf-tasks-fetched"
STEP = "fetching models"
#: The lines the fetch prints: a progress line (logged as is), the end of one model, an error.
SAY, DONE, ERROR = "SAY ", "DONE ", "ERROR "

#: Run by the node's Python with one argument: {"models": [...], "token_env": NAME or null}.
FETCH_SCRIPT = r'''
import json, os, sys, threading, time
spec = json.loads(sys.argv[1])
lock = threading.Lock()  # snapshot_download's threads update the bar: one whole line at a time
def say(prefix, what):
    with lock:
        sys.stdout.write(prefix + json.dumps(what) + "\n")
        sys.stdout.flush()
try:
    from importlib import metadata, util
    version = metadata.version("huggingface_hub")
    # hf_transfer: used by huggingface_hub before 1.0 when asked (constants.py: HF_HUB_ENABLE_HF_TRANSFER);
    # from 1.0 on it is not used, the variable only warns, and hf_xet takes its place where installed.
    if util.find_spec("hf_transfer") is not None and int(version.split(".")[0]) < 1:
        os.environ.setdefault("HF_HUB_ENABLE_HF_TRANSFER", "1")
        say("SAY ", "hf_transfer is installed: huggingface_hub %s downloads with it" % version)
    from huggingface_hub import snapshot_download
    from tqdm.auto import tqdm
except ImportError as exc:
    say("ERROR ", {"model": None, "words": "huggingface_hub is not installed in %s (%s): install it in setup "
                   "(pip install huggingface_hub), or leave the models out of the task" % (sys.executable, exc)})
    sys.exit(3)
token = os.environ.get(spec["token_env"]) or None if spec.get("token_env") else None
model = None
def size(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return "%.1f %s" % (n / scale, unit)
    return "%d B" % n
def left(seconds):
    seconds = int(seconds)
    return "%d h %02d m" % (seconds // 3600, seconds % 3600 // 60) if seconds >= 3600 else \
        "%d m %02d s" % (seconds // 60, seconds % 60) if seconds >= 60 else "%d s" % seconds
class Progress(tqdm):
    """snapshot_download's bar of the bytes of every file (huggingface_hub 1.x; its bar of files before):
    a line every few seconds, never a redraw."""
    every = float(os.environ.get("RLHF_TASKS_FETCH_EVERY", "5"))
    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)
        kwargs.update(file=open(os.devnull, "w"), disable=False)
        super().__init__(*args, **kwargs)
        self.said = time.monotonic()
    def update(self, n=1):
        out = super().update(n)
        now = time.monotonic()
        if now - self.said >= self.every:
            self.said = now
            elapsed = max(now - self.start_t, 1e-3) if hasattr(self, "start_t") else 1e-3
            rate = self.n / elapsed
            if self.unit == "B":
                total = self.total or 0
                rest = ", %s left" % left((total - self.n) / rate) if rate > 0 and total > self.n else ""
                say("SAY ", "fetching %s: %s of %s, %s/s%s" % (model, size(self.n), size(total) if total else "?",
                                                                size(rate), rest))
            else:
                say("SAY ", "fetching %s: %d of %s files" % (model, self.n, self.total or "?"))
        return out
for model in spec["models"]:
    started = time.monotonic()
    try:
        folder = snapshot_download(model, token=token, tqdm_class=Progress)
    except Exception as exc:
        words = "%s: %s" % (type(exc).__name__, exc)
        say("ERROR ", {"model": model, "words": words.replace(token, "***") if token else words})
        sys.exit(3)
    nbytes = files = 0
    for where, _, names in os.walk(folder):
        for name in names:
            files += 1
            nbytes += os.path.getsize(os.path.join(where, name))
    with open(os.path.join(os.path.dirname(os.path.dirname(folder)), ".rlhf-tasks-fetched"), "w") as handle:
        json.dump({"commit": os.path.basename(folder), "files": files, "bytes": nbytes}, handle)
    say("DONE ", {"model": model, "folder": folder, "files": files, "bytes": nbytes,
                  "seconds": round(time.monotonic() - started, 2)})
'''


def hub_cache(env: Dict[str, str]) -> str:
    """Where huggingface_hub keeps the models with this environment (constants.py: HF_HUB_CACHE, else
    HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface, that to ~/.cache)."""
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def fetched(cache: str, model: str) -> bool:
    """Whether an earlier fetch completed this model here (its marker, and the snapshot it names)."""
    folder = os.path.join(cache, "models--" + model.replace("/", "--"))
    try:
        with open(os.path.join(folder, MARKER)) as handle:
            commit = json.load(handle)["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return os.path.isdir(os.path.join(folder, "snapshots", commit))


def online(env: Dict[str, str], plan: dict) -> Dict[str, str]:
    """The node's environment with the hub online, where the plan took it offline (for setup, prepare and
    the fetch: a dataset that prepare downloads is no model fetched here)."""
    if not (plan.get("hub") or {}).get("offline"):
        return env
    return {k: v for k, v in env.items() if k != OFFLINE_ENV}


def hub_python(env: Dict[str, str]) -> List[str]:
    """The Python of the node's Ray (the job's libraries are there), else this agent's."""
    found = console_script_python(shutil.which("ray", path=env.get("PATH")))
    return found or [sys.executable]


def _bytes(n: float) -> str:
    return "%.1f GB" % (n / 1e9) if n >= 1e9 else "%.1f MB" % (n / 1e6) if n >= 1e6 else "%d bytes" % n


def fetch_models(node) -> None:
    """Before this node's Ray starts: the plan's models fetched where this node reads them. The head (or,
    without a shared cache, every node) fetches what the cache lacks; a worker on a shared cache has
    nothing to do (it joins after the head, which fetched them first)."""
    plan = node.plan
    hub = plan.get("hub") or {}
    models = hub.get("models") or []
    if not models:
        return
    cache = hub_cache(node.env)
    if hub.get("shared") and node.info.rank != 0:
        log("models: the head fetches %s into %s, which every node sees" % (", ".join(models), cache))
        return
    missing = [model for model in models if not fetched(cache, model)]
    with node.step(STEP):
        if not missing:
            log("models: %s already fetched in %s: the hub is not asked" % (", ".join(models), cache))
        else:
            _run_fetch(node, missing, hub.get("token_env"), cache)
    if hub.get("offline"):
        log("models: Ray, the job and the services run with %s=1: no node asks the hub again" % OFFLINE_ENV)


def _run_fetch(node, models: List[str], token_env: Optional[str], cache: str) -> None:
    endpoint = node.env.get("HF_ENDPOINT")
    log("models: fetching %s from %s into %s%s" % (", ".join(models), endpoint or "the Hugging Face Hub", cache, (
        " (token from $%s)" % token_env) if token_env else ""))
    started = time.monotonic()
    argv = hub_python(node.env) + ["-c", FETCH_SCRIPT, json.dumps({"models": models, "token_env": token_env})]
    errors = os.path.join(node.log_dir, "fetch-node%d.log" % node.info.rank)  # the client's own warnings
    error = None
    total = 0
    with open(errors, "ab") as err:
        # the one time the hub is asked: online whatever the task's env says (constants.py: HF_HUB_OFFLINE, or
        # TRANSFORMERS_OFFLINE, takes huggingface_hub offline)
        env = {k: v for k, v in node.env.items() if k not in (OFFLINE_ENV, "TRANSFORMERS_OFFLINE")}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err)
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                said = json.loads(line.split(" ", 1)[1]) if line.startswith((SAY, DONE, ERROR)) else None
            except ValueError:
                said = None
            if said is None:
                log("models: " + line)  # not the script's own (a library printing to stdout)
            elif line.startswith(SAY):
                log("models: " + said)
            elif line.startswith(DONE):
                total += said["bytes"]
                log("models: fetched %s: %d files, %s in %.1fs" % (said["model"], said["files"], _bytes(said["bytes"]),
                                                                 said["seconds"]))
            else:
                error = said
        code = proc.wait()
    if error is not None:
        what = "the hub refused %s" % error["model"] if error.get("model") else "%s not fetched" % ", ".join(models)
        raise AgentError(STEP, "%s, before Ray started: %s" % (what, error["words"]))
    if code != 0:
        raise AgentError(STEP, "the download exited with code %d (its output: %s)" % (code, errors))
    log("models: %s fetched in %.1fs (%s)" % (", ".join(models), time.monotonic() - started, _bytes(total)))
