"""The task file: what a user writes, parsed into strict pydantic models.

Provider-neutral. Every error names the field path (`services[0].ready.http`) and
the task file, and is raised as BadInput (exit 2) before anything is launched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, PrivateAttr, ValidationError, WithJsonSchema, field_validator, model_validator

from .errors import BadInput
from .models import NAME_PATTERN, Duration, Service, Size, StrictModel, require_absolute
from .recipes import JOB_MODELS

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GPU = re.compile(r"^(?:(?P<name>[A-Za-z][A-Za-z0-9._-]*)(?::(?P<count>\d+))?|(?P<only>\d+))$")


class Resources(StrictModel):
    gpus: str | None = Field(None, description="per node: NAME:COUNT (H100:8), NAME (one GPU) or COUNT")
    cpus: int | None = Field(None, ge=1, description="CPUs per node to register with Ray")
    memory: Size | None = None
    shm_size: Size | None = None
    disk: Size | None = None

    @field_validator("gpus")
    @classmethod
    def _gpu_spec(cls, value):
        if value is None:
            return value
        match = _GPU.match(str(value))
        count = match and (match.group("count") or match.group("only"))
        if not match or (count is not None and int(count) < 1):
            raise ValueError(f"{value!r} is not a GPU spec (use NAME:COUNT such as H100:8, or a count >= 1)")
        return str(value)

    @property
    def gpu_name(self) -> str | None:
        return _GPU.match(self.gpus).group("name") if self.gpus else None

    @property
    def gpus_per_node(self) -> int:
        if not self.gpus:
            return 0
        match = _GPU.match(self.gpus)
        return int(match.group("count") or match.group("only") or 1)


class RayConfig(StrictModel):
    port: int = Field(6379, ge=1024, le=65535)
    dashboard_port: int = Field(8265, ge=1024, le=65535)
    client_server_port: int = Field(10001, ge=1024, le=65535)
    ready_port: int = Field(6390, ge=1024, le=65535, description="the head agent's ready beacon: workers join when it answers")
    dashboard_public: bool = Field(False, description="bind the dashboard to the private address instead of 127.0.0.1")
    auth: Literal["token", "none"] = "token"
    debug: Literal["off", "legacy", "post_mortem"] = "off"
    object_store_memory: Size | None = None

    @model_validator(mode="after")
    def _ports(self):
        ports = {"port": self.port, "dashboard_port": self.dashboard_port, "client_server_port": self.client_server_port,
                 "ready_port": self.ready_port}
        for field, port in ports.items():
            if 10002 <= port <= 19999 and field != "client_server_port":
                raise ValueError(f"{field} {port} is inside Ray's worker port range 10002-19999")
        if len(set(ports.values())) != len(ports):
            raise ValueError(f"ports must differ: {ports}")
        return self


class Checkpoints(StrictModel):
    path: str | None = Field(None, description="absolute, shared by all nodes; the provider picks one when omitted")
    resume: Literal["auto", "never"] = "auto"
    volume: str | None = Field(None, description="a network volume to mount at path, where the provider has them")

    _absolute = field_validator("path")(classmethod(lambda cls, v: require_absolute(
        v, "relative paths resolve inside Ray's working_dir copy")))


class Wait(StrictModel):
    head: Duration = Field(1800.0, description="how long workers wait for the head (it runs setup and prepare first)")
    nodes: Duration = Field(1200.0, description="how long the head waits for every node to join")


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


def _bandwidth_text(value: Any) -> Any:
    bandwidth_bits(value)  # validates; kept as written
    return value


class Preflight(StrictModel):
    """The checks the head runs across every node once they are ALIVE and before the job
    is submitted: versions, the collective network interface of each node, a Gloo
    all_reduce (NCCL too where there are GPUs) and the bandwidth of every pair of nodes."""

    enabled: bool = Field(True, description="false (or `preflight: off`) skips the checks")
    timeout: Duration = Field(120.0, description="deadline for all of preflight; a node that does not answer "
                              "by then is named and the job is not submitted")
    min_bandwidth: Annotated[str, BeforeValidator(_bandwidth_text)] = Field(
        "1Gbit", description="below this (per pair of nodes, and the all_reduce's bus bandwidth) "
        "preflight warns; it never fails on bandwidth")

    @property
    def min_bandwidth_bits(self) -> float:
        return bandwidth_bits(self.min_bandwidth)


def _preflight_shorthand(value: Any) -> Any:
    """`preflight: off` / `on` (YAML reads them as booleans) stand for {enabled: false/true}."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
        return {"enabled": value.lower() in ("on", "true")}
    return value


PreflightField = Annotated[Preflight, BeforeValidator(_preflight_shorthand), WithJsonSchema({"anyOf": [
    {"type": "boolean"}, {"enum": ["on", "off"]}, Preflight.model_json_schema()]})]


_RECIPES = {m.model_fields["recipe"].annotation.__args__[0] for m in JOB_MODELS}


class Placement(StrictModel):
    """Where and how the provider may place the nodes (used by the providers that have it)."""

    spot: Literal["off", "on", "auto"] = Field("off", description="spot instances: off, on, or auto (spot when available)")
    max_duration: Duration | None = Field(None, description="stop the run after this long")
    retry: bool = Field(False, description="let the provider relaunch the run after an interruption or no capacity")
    fleets: list[str] = Field([], description="named pools of machines to run on, where the provider has them")
    backends: list[str] = Field([], description="clouds or backends the provider may use")
    regions: list[str] = []


Job = Annotated[Union[JOB_MODELS], Field(discriminator="recipe")]  # type: ignore[valid-type]


class Task(StrictModel):
    _source: str = PrivateAttr("<task>")

    name: str = Field(pattern=NAME_PATTERN, description="lowercase letters, digits and dashes")
    nodes: int = Field(ge=1, le=1024)
    resources: Resources = Resources()
    image: str | None = None
    env: dict[str, str] = {}
    secrets: list[str] = Field([], description="names of environment variables taken from the launcher's environment")
    setup: list[str] = []
    prepare: list[str] = []
    services: list[Service] = []
    network: str = Field("auto", pattern=NAME_PATTERN,
                         description="network preset: auto, ethernet, infiniband, or one the provider offers")
    ray: RayConfig = RayConfig()
    checkpoints: Checkpoints = Checkpoints()
    wait: Wait = Wait()
    placement: Placement = Placement()
    preflight: PreflightField = Preflight()
    job: Job

    @property
    def source(self) -> str:
        """The task file it came from, for error messages."""
        return self._source

    @field_validator("env")
    @classmethod
    def _env_names(cls, value):
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value):
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name (secrets are listed by name only)")
        if len(set(value)) != len(value):
            raise ValueError("secrets are listed twice")
        return value

    @field_validator("services")
    @classmethod
    def _unique_services(cls, value):
        names = [s.name for s in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate service names {duplicates}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self):
        clash = sorted(set(self.env) & set(self.secrets))
        if clash:
            raise ValueError(f"env and secrets both define {clash}: a secret's value must not be in the task file")
        return self


def _field_path(loc: tuple) -> str:
    """('services', 0, 'ready', 'http') -> 'services[0].ready.http' (union tags dropped)."""
    path = ""
    for index, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif (part in {"http", "tcp"} and loc[index - 1] == "ready") or (part in _RECIPES and loc[index - 1] == "job"):
            continue  # union tags are not field names
        else:
            path += f".{part}" if path else str(part)
    return path or "(top level)"


def parse_task(data: Any, source: str = "<task>") -> Task:
    """Validate a task mapping; BadInput lists every problem with its field path."""
    if not isinstance(data, dict):
        raise BadInput(f"{source}: a task file must be a mapping of fields, got {type(data).__name__}")
    try:
        task = Task.model_validate(data)
        task._source = source
        return task
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {_field_path(err['loc'])}: {msg}")
        raise BadInput(f"{source}: invalid task\n" + "\n".join(dict.fromkeys(lines))) from None


def load_task(path: str | Path) -> Task:
    """Read and validate a task file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read task file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML: {exc}") from None
    return parse_task(data, str(path))


def json_schema() -> dict:
    """JSON Schema of the task file, for editors (yaml-language-server)."""
    schema = Task.model_json_schema(by_alias=True)
    schema["title"] = "rlhf-tasks task file"
    return schema
