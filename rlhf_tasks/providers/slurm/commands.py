"""Slurm's own commands, run on this machine (a login node): where they are, Slurm's record of a job
(`scontrol show job`, else sacct) and following it (SlurmJob), sbatch's word on a script without submitting
it (`sbatch --test-only`), and the files sbatch names by its filename pattern.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from ...errors import BadInput

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


def slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BadInput(f"--provider slurm: the `{name}` command is not on PATH; run rlhf-tasks on a Slurm login node")
    return path


_PATTERN = re.compile(r"%(\d*)(.)")


def filename(pattern: str, name: str, job_id: str, directory: Path) -> Path | None:
    """The batch script's --output/--error file: sbatch's filename pattern (sbatch(1)) with what Slurm puts for
    a job that is no array (%j and %A the job id, %x its name, %u the user, %% a %; a number pads with zeros),
    relative to the submission directory; None where it holds what only the node knows (%N, the host)."""
    unknown = False

    def one(match: re.Match) -> str:
        nonlocal unknown
        width, letter = match.groups()
        value = {"j": job_id, "A": job_id, "x": name, "u": getpass.getuser(), "%": "%"}.get(letter)
        if value is None:
            unknown = True
            return ""
        return value.zfill(int(width)) if width and value.isdigit() else value

    path = _PATTERN.sub(one, pattern)
    return None if unknown else directory / path


def job_info(job_id: str) -> dict[str, str]:
    """Slurm's record of a job: `scontrol show job` while slurmctld keeps it (MinJobAge),
    else sacct (where there is an accounting database); {} when neither knows it."""
    out = subprocess.run([slurm_command("scontrol"), "-o", "show", "job", str(job_id)], capture_output=True, text=True)
    if out.returncode == 0 and f"JobId={job_id} " in out.stdout:
        fields = {}
        for word in out.stdout.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields
    sacct = shutil.which("sacct")
    if sacct:
        out = subprocess.run([sacct, "-j", str(job_id), "-X", "-n", "-P", "-o", "State,ExitCode,Reason,NodeList"],
                             capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if line:
            state_, code, reason, nodes = (line.split("|") + ["", "", "", ""])[:4]
            return {"JobState": state_.split()[0], "ExitCode": code, "Reason": reason, "NodeList": nodes}
    return {}


def exit_text(info: dict[str, str]) -> str:
    """Slurm's ExitCode (code:signal) in words."""
    code, _, signal = info.get("ExitCode", "?").partition(":")
    return f"exit code {code}" + (f" (signal {signal})" if signal not in ("", "0") else "")


#: sbatch's words where it reached no Slurm here (no configuration, no controller): nothing was checked.
UNREACHED = ("Could not establish a configuration source", "Unable to process configuration file",
             "Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted or received")
TEST_ONLY_S = 60
#: Where sbatch finds its configuration without SLURM_CONF: the builds' defaults (Debian's and a source build's
#: sysconfdir) and the copy slurmd/sackd keep on a configless node.
SLURM_CONFS = ("/etc/slurm/slurm.conf", "/usr/local/etc/slurm.conf", "/etc/slurm-llnl/slurm.conf",
               "/run/slurm/conf/slurm.conf")


def slurm_config() -> str | None:
    """The configuration sbatch reads here, or None: without one it reaches no Slurm (its DNS SRV lookup
    aside), so `check` does not start it."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    return next((path for path in SLURM_CONFS if os.path.exists(path)), None)


def sbatch_version(sbatch: str) -> str:
    """`slurm 22.05.8`: sbatch's own name for its release."""
    out = subprocess.run([sbatch, "--version"], capture_output=True, text=True, timeout=TEST_ONLY_S)
    return out.stdout.strip() or "slurm"


def sbatch_test_only(sbatch: str, script: str) -> tuple[bool | None, str]:
    """`sbatch --test-only` of a script (on its stdin): sbatch parses its #SBATCH lines and slurmctld says
    whether and when the job would start; nothing is submitted. (True, the estimate), (False, sbatch's
    words), or (None, its words) where it reached no Slurm, so nothing was checked."""
    try:
        out = subprocess.run([sbatch, "--test-only"], input=script, capture_output=True, text=True,
                             timeout=TEST_ONLY_S)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {TEST_ONLY_S}s"
    said = [line.strip() for line in (out.stderr + out.stdout).splitlines()
            if line.strip() and not line.startswith('Try "sbatch --help"')]
    words = "; ".join(said) or f"exit code {out.returncode}"
    if out.returncode == 0:
        return True, words
    return (None if any(w in words for w in UNREACHED) else False), words


class SlurmJob:
    """Slurm's record of one job, asked at most once a second: whether it still runs (the
    head's agent runs inside it), its state as it changes (with Slurm's reason while it
    waits), and how it ended."""

    #: A job Slurm does not know for this long (not yet visible, or forgotten) has ended.
    UNKNOWN_S = 60.0

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.info: dict[str, str] = {}
        self.asked = 0.0
        self.unknown_since: float | None = None
        self.shown: tuple | None = None

    def _refresh(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self.asked >= 1.0:
            self.asked, info = now, job_info(self.job_id)
            if info:
                self.info, self.unknown_since = info, None
            else:
                self.unknown_since = self.unknown_since or now
        return self.info

    def running(self) -> bool:
        info = self._refresh()
        if self.unknown_since is not None and time.monotonic() - self.unknown_since > self.UNKNOWN_S:
            return False
        return info.get("JobState") not in FINAL_STATES

    def changes(self) -> list[str]:
        info = self._refresh()
        current = (info.get("JobState"), info.get("Reason"))
        if not info or current == self.shown:
            return []
        self.shown = current
        reason = f" ({current[1]})" if current[1] and current[1] != "None" else ""
        where = f" on {info['NodeList']}" if current[0] == "RUNNING" and info.get("NodeList") else ""
        return [f"Slurm job {self.job_id}: {current[0]}{reason}{where}"]

    def describe(self) -> list[str]:
        self.asked = 0.0  # the summary wants the latest word
        info = self._refresh()
        if not info:
            return [f"Slurm job {self.job_id}: unknown to Slurm"]
        if info.get("JobState") in FINAL_STATES:
            return [f"Slurm job {self.job_id} {info['JobState']} with {exit_text(info)}"]
        return [f"Slurm job {self.job_id}: {info.get('JobState')}"]
