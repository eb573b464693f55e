"""Models shared by the task spec, the recipes and the plan: the strict base, durations
and sizes parsed once, and the service model (a task's services and a recipe's go
through the same one). A leaf module: it imports nothing else of the package's but
errors, so recipes and spec can both use it."""

from __future__ import annotations

import difflib
import math
import re
from fractions import Fraction
from typing import Annotated, Any, Literal, Sequence, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, field_validator,
                      model_validator)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
#: The units a size is written in (case ignored): MB, GB, TB are powers of 10 (as Kubernetes' M, G, T), MiB, GiB,
#: TiB powers of 2 (as Kubernetes' Mi, Gi, Ti; and as dstack's, SkyPilot's, Slurm's and docker's MB, GB or G).
SIZE_UNITS = {"MB": 10**6, "GB": 10**9, "TB": 10**12, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*[MGTmgt]([Bb]|i[Bb])\s*$"
_SIZE_WORDS = ("sizes need a unit: MB, GB, TB, MiB, GiB, TiB; a bare number was bytes on some providers "
               "(KubeRay, SkyPilot's --shm-size) and gigabytes on others (dstack, SkyPilot's disk_size)")
#: Units of other tools, read only to say the right form: Kubernetes' and docker's short ones, and sizes below a MB.
_OTHER_UNITS = {"k": 10**3, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "b": 1, "kb": 10**3, "kib": 2**10}
_AMBIGUOUS = {"m": ("M", 6), "g": ("G", 9), "t": ("T", 12)}
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"


class StrictModel(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class WandbOptions(StrictModel):
    """Where a run logs in W&B, at `placement.wandb` or `job.wandb` (the job's fields win). Logging
    itself is on when WANDB_API_KEY is given (a secret of the task)."""

    entity: str | None = Field(None, description="W&B entity (team or user): WANDB_ENTITY, or the framework's flag")
    project: str | None = Field(None, description="W&B project: the framework's own project flag, and WANDB_PROJECT")
    group: str | None = Field(None, description="W&B run group: WANDB_RUN_GROUP, or the framework's flag")
    tags: list[str] = Field([], description="W&B tags: WANDB_TAGS")

    def merged(self, over: "WandbOptions | None") -> "WandbOptions":
        """These options with `over`'s set fields in their place."""
        return self if over is None else self.model_copy(update=over.model_dump(exclude_unset=True))

    def env(self) -> dict[str, str]:
        """W&B's own environment variables, which wandb.init reads whatever framework calls it."""
        pairs = {"WANDB_ENTITY": self.entity, "WANDB_PROJECT": self.project, "WANDB_RUN_GROUP": self.group,
                 "WANDB_TAGS": ",".join(self.tags) or None}
        return {key: value for key, value in pairs.items() if value}


def did_you_mean(word: str, choices, listing: str = "choose one of") -> str:
    """'(did you mean steps?)' for a near miss, else '(choose one of: a, b, c)'. A near miss is a word
    whose parts (split at `_`, `.`, `-`) abbreviate one choice's (`rollout_tp`: rollout_tensor_parallel_size),
    or a typo of one: difflib's closest match whose parts are each close to the word's (so `rollout_tp`, two
    letters from `rollout_n` but no typo of it, is never offered `rollout_n`)."""
    choices = list(choices)
    word = str(word)
    abbreviated = [c for c in choices if c != word and _abbreviates(_parts(word), _parts(c))]
    if len(abbreviated) > 1:  # `rollout`: the start of several; none is meant more than another
        return f"({listing}: {', '.join(choices)})"
    close = abbreviated or \
        [c for c in difflib.get_close_matches(word, choices, n=3, cutoff=0.7) if _typo_of(word, c)][:1]
    starting = [c for c in choices if word and c.startswith(word)]
    close = close or (starting if len(starting) == 1 else [])
    return f"(did you mean {close[0]}?)" if close else f"({listing}: {', '.join(choices)})"


def _parts(name: str) -> list[str]:
    return [part for part in re.split(r"[_.\-]", name.lower()) if part]


def _abbreviates(word: list[str], choice: list[str]) -> bool:
    """Each part of the word is a prefix of the choice's next part, or the initials of its next parts
    (`tp`: tensor_parallel); the choice may go on after the word ends (`_size`)."""
    if not word or not choice:
        return False
    head, rest = word[0], word[1:]
    if len(head) >= 2 and choice[0].startswith(head) and (not rest or _abbreviates(rest, choice[1:])):
        return True
    n = len(head)
    if n >= 2 and len(choice) >= n and "".join(part[0] for part in choice[:n]) == head:
        return not rest or _abbreviates(rest, choice[n:])
    return False


def _typo_of(word: str, choice: str) -> bool:
    """Whether `word` reads as `choice` mistyped: part by part close where they have as many parts,
    else close as a whole once the separators are dropped."""
    ours, theirs = _parts(word), _parts(choice)
    if len(ours) == len(theirs):
        return all(a == b or difflib.SequenceMatcher(None, a, b).ratio() >= 0.5 for a, b in zip(ours, theirs))
    return difflib.SequenceMatcher(None, "".join(ours), "".join(theirs)).ratio() >= 0.85


def parse_duration(value: str | int | float) -> float:
    """'90s', '15m', '2h' or a number of seconds -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a duration (use e.g. 90s, 15m, 2h)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def _quoted(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def size_bytes(value: Any) -> int:
    """'128GB' (10^9 bytes each), '64GiB' (2^30), '200MB', '1.5TB' -> bytes, a fraction of a byte rounded up.
    Anything else, a bare number first, is a ValueError that shows the right form."""
    text = str(value).strip()
    match = _SIZE.match(text) if not isinstance(value, bool) else None
    number, unit = (Fraction(match.group(1)), match.group(2)) if match else (None, "")
    units = {name.lower(): size for name, size in SIZE_UNITS.items()}
    if match and not unit:
        guess = size_text(int(number), _GRAMMAR) if number >= 2**20 and number.denominator == 1 else f"{text}GB"
        raise ValueError(f"{_quoted(value)} has no unit: write {guess} ({_SIZE_WORDS})")
    if match and unit.lower() in units:
        nbytes = math.ceil(number * units[unit.lower()])
        if nbytes <= 0:
            raise ValueError(f"{_quoted(value)} is not a size: a size is more than 0 bytes")
        return nbytes
    if match and unit.lower() in _AMBIGUOUS:  # Kubernetes' G is 10^9 bytes, docker's and Slurm's 2^30
        big, power = _AMBIGUOUS[unit.lower()]
        raise ValueError(f"{_quoted(value)} is not a size: write {match.group(1)}{big}B (10^{power} bytes each) or "
                         f"{match.group(1)}{big}iB (2^{power // 3 * 10}) ({_SIZE_WORDS})")
    if match and unit.lower() in _OTHER_UNITS:
        right = size_text(math.ceil(number * _OTHER_UNITS[unit.lower()]),
                          _BINARY if "i" in unit.lower() else _DECIMAL)
        raise ValueError(f"{_quoted(value)} is not a size: write {right} ({_SIZE_WORDS})")
    raise ValueError(f"{_quoted(value)} is not a size: write e.g. 128GB, 500GB, 64GiB ({_SIZE_WORDS})")


def _exact_decimal(value: Fraction) -> str | None:
    """A fraction as the decimal it is exactly ('122070.3125'), None where it has none within 30 digits."""
    for digits in range(31):
        scaled = value * 10**digits
        if scaled.denominator == 1:
            whole = str(scaled.numerator).rjust(digits + 1, "0")
            return whole if not digits else f"{whole[:-digits]}.{whole[-digits:]}"
    return None


def size_text(nbytes: int, units: Sequence[tuple[str, int]]) -> str:
    """`nbytes` exactly, in the first of `units` ((suffix, bytes), biggest first) it is a whole number of
    ('64GB'), else as the shortest exact decimal among them ('122070.3125MB')."""
    whole = [f"{nbytes // size}{suffix}" for suffix, size in units if nbytes % size == 0]
    exact = [f"{text}{suffix}" for suffix, size in units if (text := _exact_decimal(Fraction(nbytes, size)))]
    return whole[0] if whole else min(exact, key=len)


_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6))
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20))
_GRAMMAR = (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6))


_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(bit|bps|B/s)\s*$", re.IGNORECASE)
_BANDWIDTH_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def bandwidth_bits(value: str | int | float) -> float:
    """'1Gbit', '100Mbit', '200Mbps', '1GB/s' or a number of bits per second -> bits per second."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bits = float(value)
    else:
        match = _BANDWIDTH.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a bandwidth (use e.g. 1Gbit, 100Mbit, 200Mbps, 1GB/s)")
        bits = float(match.group(1)) * _BANDWIDTH_SCALE[match.group(2).lower()]
        bits *= 8 if match.group(3).lower() == "b/s" and match.group(3)[0] == "B" else 1
    if bits <= 0:
        raise ValueError("a bandwidth must be positive")
    return bits


#: Seconds, written as '90s', '15m', '2h' or a number in a task file; parsed once, here.
Duration = Annotated[float, BeforeValidator(parse_duration),
                     WithJsonSchema({"anyOf": [{"type": "string", "pattern": _DURATION.pattern}, {"type": "number"}]})]


def _size_text(value: Any) -> Any:
    size_bytes(value)  # validates; the text is kept, and each provider renders its bytes in its own form
    return str(value).strip()


#: A size as written ('128GB'); `size_bytes` turns it into bytes, and each provider's render into its own form.
Size = Annotated[str, BeforeValidator(_size_text), WithJsonSchema({"type": "string", "pattern": SIZE_PATTERN})]


def require_absolute(value: str | None, why: str = "every node reads it") -> str | None:
    """Paths that travel to the nodes must be absolute (relative ones resolve inside Ray's working_dir copy)."""
    if value is not None and not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path: {why}")
    return value


class HttpReady(StrictModel):
    """Ready when this request answers with a status below 400 (POST with a body for
    servers whose GET answers 405, like OpenRLHF-M's reward server)."""

    http: str = Field(description="URL; {node_addr} and {head_addr} are filled in on the node")
    method: Literal["GET", "POST", "HEAD"] = "GET"
    json_body: Any = Field(None, alias="json")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("http")
    @classmethod
    def _url(cls, value):
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value


class TcpReady(StrictModel):
    tcp: int = Field(ge=1, le=65535, description="ready when this port accepts connections")
    host: str = "{node_addr}"


def _ready_kind(value) -> str | None:
    if isinstance(value, dict):
        return "http" if "http" in value else "tcp" if "tcp" in value else None
    return "http" if isinstance(value, HttpReady) else "tcp" if isinstance(value, TcpReady) else None


#: Where a service runs: the head, every node, or the nodes of one group of the task (`group reward`).
_WHERE = re.compile(r"^(head|every_node|group " + NAME_PATTERN.strip("^$") + r")$")
WHERE_WORDS = "write head, every_node or group NAME (one of the task's groups)"


def group_where(where: str) -> str | None:
    """The group a service's `where:` names (`group reward` -> reward); None for head and every_node."""
    return where[len("group "):] if where.startswith("group ") else None


class Service(StrictModel):
    """A process the cluster needs before the job (a reward server, a retriever)."""

    name: str = Field(pattern=NAME_PATTERN)
    where: Annotated[str, WithJsonSchema({"type": "string", "pattern": _WHERE.pattern, "default": "head"})] = Field(
        "head", description="head, every_node, or group NAME: the nodes of that group of the task's groups")
    command: str = Field(min_length=1)
    ready: Annotated[
        Union[Annotated[HttpReady, Tag("http")], Annotated[TcpReady, Tag("tcp")]],
        Discriminator(_ready_kind, custom_error_type="ready", custom_error_message="ready needs either http: URL or tcp: PORT"),
    ] | None = None
    timeout: Duration = 600.0
    env: dict[str, str] = {}

    @field_validator("where")
    @classmethod
    def _where(cls, value: str) -> str:
        if not _WHERE.match(value):
            raise ValueError(f"{value!r}: {WHERE_WORDS}")
        return value


#: Variables the launcher sets on every node itself (the cluster's own token, and the auth mode
#: that goes with ray.auth): never the task's. The provider's contract variables are refused by
#: the provider, which alone knows them (plan.check_contract_env).
LAUNCHER_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RuntimeEnvSpec(StrictModel):
    """A job's runtime_env (runtimeenv.py), in Ray's own terms (ray.runtime_env.RuntimeEnv): what these fields
    may hold beyond their shape is Ray's to say, and `check` asks it."""

    pip: Union[list, str, dict, None] = Field(None, description=(
        "pip packages Ray installs for the job on every node: a list, a requirements file (read here when it "
        "is on this machine, relative to the task file; an absolute path that is not is read on the head), or "
        "Ray's {packages, pip_check, pip_version, pip_install_options}"))
    uv: Union[list, str, dict, None] = Field(None, description=(
        "as pip, installed with uv: a list, a requirements file, or Ray's {packages, uv_check, uv_version, "
        "uv_pip_install_options}"))
    env_vars: dict[str, str] = Field({}, description=(
        "variables the job's processes get (Ray's env_vars), written into the rendered files as env is: no "
        "secrets here (list those under secrets)"))
    py_modules: list[str] = Field([], description=(
        "Python packages or modules Ray uploads for the job: paths (relative to the task file; inside "
        "job.working_dir on providers that ship it) or URIs Ray fetches"))
    excludes: list[str] = Field([], description=(
        "more of Ray's excludes (gitignore rules), after job.excludes: one list for the working_dir and every "
        "py_module"))

    @model_validator(mode="before")
    @classmethod
    def _not_working_dir(cls, data: Any) -> Any:
        if isinstance(data, dict) and "working_dir" in data:
            raise ValueError("working_dir is job.working_dir (relative to the task file's directory, or absolute, "
                             "or null): move it there")
        return data

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if key in LAUNCHER_ENV:
                raise ValueError(f"{key}: the launcher sets it on every node itself (each cluster gets its own "
                                 f"token, and the auth mode of ray.auth); remove it")
        return value

    def given(self) -> list[str]:
        """The fields the task gives (for `check`'s words)."""
        return [name for name in ("pip", "uv", "env_vars", "py_modules", "excludes") if getattr(self, name)]
