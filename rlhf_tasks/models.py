"""Models shared by the task spec, the recipes and the plan: the strict base, durations
and sizes parsed once, and the service model (a task's services and a recipe's go
through the same one). A leaf module: it imports nothing else of the package's but
errors, so recipes and spec can both use it."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, field_validator

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
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


def size_bytes(value: str | int) -> int:
    """'128GB', '64GiB', '200MB' or a number of bytes -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (use e.g. 128GB, 500GB, 64GiB)")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


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
    size_bytes(value)  # validates; the text is kept, since providers render it as written
    return value


#: A size as written ('128GB'); `size_bytes` turns it into bytes where a number is needed.
Size = Annotated[str, BeforeValidator(_size_text)]


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


class Service(StrictModel):
    """A process the cluster needs before the job (a reward server, a retriever)."""

    name: str = Field(pattern=NAME_PATTERN)
    where: Literal["head", "every_node"] = "head"
    command: str = Field(min_length=1)
    ready: Annotated[
        Union[Annotated[HttpReady, Tag("http")], Annotated[TcpReady, Tag("tcp")]],
        Discriminator(_ready_kind, custom_error_type="ready", custom_error_message="ready needs either http: URL or tcp: PORT"),
    ] | None = None
    timeout: Duration = 600.0
    env: dict[str, str] = {}
