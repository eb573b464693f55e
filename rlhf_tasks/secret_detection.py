"""Whether a string the task file writes holds a secret's value: by a variable's name (HF_TOKEN), a
credential's format (hf_..., sk-..., a PEM key), a secret-named variable or flag given a value written there.

Its own module because more than the task's models ask it: spec.py refuses a task whose fields hold one
(every field is written into the rendered files and the plan the nodes read), and runtimeenv.py asks the
same of a runtime_env's env files. It only finds and says why, never the value.
"""

from __future__ import annotations

import re
from typing import Any

#: Names that are secrets by convention: *_KEY (WANDB_KEY, OPENAI_KEY, *_API_KEY, *_ACCESS_KEY), *_TOKEN
#: (HF_TOKEN, GITHUB_TOKEN, AWS_SESSION_TOKEN), and any name holding SECRET, PASS (DB_PASS, *PASSWORD*,
#: PASSPHRASE), PWD (MY_PWD), CREDENTIAL or PRIVATE.
_SECRET_NAME = re.compile(r"(?:^|_)(?:API_?KEY|KEY|TOKEN)$|SECRET|PASS|PWD|CREDENTIAL|PRIVATE", re.IGNORECASE)
#: Values in well-known credential formats, found anywhere in the value (not inside a longer word);
#: not exhaustive.
_SECRET_VALUES = {
    "a Hugging Face token (hf_...)": r"hf_[A-Za-z0-9]{30,}",
    "an OpenAI or Anthropic API key (sk-...)": r"sk-[A-Za-z0-9_-]{20,}",
    "a GitHub token (ghp_..., github_pat_...)": r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}",
    "an AWS access key id (AKIA...)": r"(?:AKIA|ASIA)[A-Z0-9]{16}",
    "a RunPod API key (rpa_...)": r"rpa_[A-Za-z0-9]{20,}",
    "a PEM private key (-----BEGIN ... PRIVATE KEY-----)": r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----",
    # (`://user:$TOKEN@` and `:${TOKEN}@` refer to a variable: they pass)
    "a URL with a password (scheme://user:password@host)": r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:(?!\$)[^\s/@]+@",
    "a JSON Web Token (eyJ...)": r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*",
    "a Slack token (xox?-...)": r"xox[a-z]-[A-Za-z0-9-]{10,}",
    "a GitLab token (glpat-...)": r"glpat-[A-Za-z0-9_-]{20,}",
    "a Stripe live key (sk_live_..., rk_live_...)": r"[sr]k_live_[A-Za-z0-9]{16,}",
    "a Google API key (AIza...)": r"AIza[A-Za-z0-9_-]{35}",
    "an HTTP bearer token (Bearer ...)": r"(?i:bearer)[ \t]+[A-Za-z0-9._~+/=-]{8,}",
}
_SECRET_VALUES = {what: re.compile(r"(?<![A-Za-z0-9_])(?:" + pattern + ")") for what, pattern in _SECRET_VALUES.items()}
#: W&B's keys are 40 hex digits, like a git commit: only a value that is nothing else counts.
_WANDB_VALUE = re.compile(r"[0-9a-f]{40}")


def secret_look(name: str, value: str) -> str | None:
    """Why an env entry looks like a secret (its name, or its value's format), or None."""
    if _SECRET_NAME.search(name):
        return "its name says it is a secret"
    for what, pattern in _SECRET_VALUES.items():
        if pattern.search(value):
            return f"its value looks like {what}"
    if _WANDB_VALUE.fullmatch(value.strip()):
        return "its value looks like a W&B API key (40 hex digits)"
    return None


#: In a command or an argument, a variable whose name says it is a secret set to a value written there
#: (`HF_TOKEN=...`, `export WANDB_API_KEY=...`); `NAME=$VAR` refers to one and passes, as does a Hydra
#: override's key (`model.token=...`: its value is checked for a credential's format).
_ASSIGNMENT = re.compile(r"(?<![\w.$/-])(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?![\"']?\$)[\"']?[^\s\"'$;&|)]")
#: A flag given a value written there (`--api-key VALUE`, `--password=VALUE`); `--token $HF_TOKEN` passes.
_FLAG = re.compile(r"(?<![\w-])--?(?P<flag>[A-Za-z][\w-]*)(?:=|\s+)(?![\"']?\$)[\"']?(?P<value>[^\s\"'$;&|)]+)")
#: Flags that take a secret (a tokenizer's `--eos_token` and the like do not).
_SECRET_FLAG = re.compile(r"(?:hf_|auth_|access_|api_)?token|(?:\w+_)?api_?key|(?:\w+_)?passw(?:or)?d|(?:\w+_)?secret"
                          r"(?:_key)?|(?:\w+_)?access_key")
#: Flags whose value is a W&B key (OpenRLHF's `--use_wandb KEY`) when it has the key's form.
_WANDB_FLAG = re.compile(r"use_wandb|wandb_(?:api_)?key")
_WANDB_LOGIN = re.compile(r"\bwandb\s+login\s+(?:--?[\w-]+\s+)*[\"']?[0-9a-f]{40}(?![0-9A-Za-z])")


def _flag_look(flag: str, value: str) -> str | None:
    name = flag.lower().replace("-", "_")
    if _SECRET_FLAG.fullmatch(name) or (_WANDB_FLAG.fullmatch(name) and _WANDB_VALUE.fullmatch(value)):
        return f"it gives --{flag.lstrip('-')} a value written here"
    return None


def secret_in_text(text: str) -> str | None:
    """Why a string the task writes outside env (a command, a URL, a recipe's argument) looks like it holds a
    secret's value, or None: a credential's format anywhere in it, a secret-named variable set to a value
    written there, a secret's flag given one, `wandb login KEY`. References (`$HF_TOKEN`) pass."""
    for what, pattern in _SECRET_VALUES.items():
        if pattern.search(text):
            return f"it holds what looks like {what}"
    for match in _ASSIGNMENT.finditer(text):
        if _SECRET_NAME.search(match.group("name")):
            return f"it sets {match.group('name')}, whose name says it is a secret, to a value written here"
    for match in _FLAG.finditer(text):
        why = _flag_look(match.group("flag"), match.group("value"))
        if why:
            return why
    if _WANDB_LOGIN.search(text):
        return "it holds what looks like a W&B API key (wandb login with 40 hex digits)"
    return None


def _argv_look(flag: str, value: str) -> str | None:
    """Why the list item `value`, after the item `flag`, is a secret's value given to a flag (`["--password", X]`)."""
    match = re.fullmatch(r"--?(?P<flag>[A-Za-z][\w-]*)", flag)
    if not match or not value or value.startswith("$"):
        return None
    return _flag_look(match.group("flag"), value)


#: Mappings of the task whose entries are environment variables: checked by name and value, as `env` is.
ENV_MAPPINGS = re.compile(r"^(?:services\[\d+\]\.env|job\.runtime_env\.env_vars)$")


def written_secrets(data: Any, path: str = "") -> dict[str, str]:
    """Every string below `data` (a task's fields as data) that looks like a secret's value: its field path
    (`setup[0]`, `job.args.extra_overrides[3]`, `services[0].ready.json.auth`) and why, never the value."""
    found: dict[str, str] = {}
    if isinstance(data, str):
        why = secret_in_text(data)
        if why:
            found[path] = why
    elif isinstance(data, dict):
        for key, value in data.items():
            here = f"{path}.{key}" if path else str(key)
            if ENV_MAPPINGS.match(path) and isinstance(value, str):
                why = secret_look(str(key), value)
                if why:
                    found[here] = why
                continue
            found.update(written_secrets(value, here))
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            found.update(written_secrets(value, f"{path}[{index}]"))
            previous = data[index - 1] if index else None
            if isinstance(previous, str) and isinstance(value, str) and f"{path}[{index}]" not in found:
                why = _argv_look(previous, value)
                if why:
                    found[f"{path}[{index}]"] = why
    return found
