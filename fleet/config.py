"""fleet.toml: the validated run spec.

pydantic does the validation (types, ranges, unknown keys); this module turns its errors into one
line that names the file, the line and the key path, with a suggestion for a misspelt key. Paths in
[run] are paths on the hosts; for the `local` host, relative paths are taken from fleet.toml's
folder.
"""

from __future__ import annotations

import difflib
import os
import re
import string
import sys
from typing import Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from worker.formats import FORMATS, LOSS_MASKS, FormatError, check_dtype
from worker.layers import LayerError, check_spec
from worker.ship import ShipError, destination
from worker.text import parse_bytes, printable

if sys.version_info >= (3, 11):
    import tomllib
else:                                     # pragma: no cover
    import tomli as tomllib

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PLACEHOLDERS = {"python", "shard", "num_shards", "gpu", "gpus", "host", "output", "run", "model", "data",
                "shard_dir", "start", "end"}
ROW_PLACEHOLDERS = {"start", "end"}       # a [job] taking these gets its rows in leases (worker/ranged.py)

# worker.formats' FORMATS and LOSS_MASKS as types, spelled out (a type checker takes no Literal of a
# tuple); checked equal here, so neither can change alone.
Format = Literal["speculators", "specforge-eagle3", "specforge-dflash", "eagle"]
LossMask = Literal["assistant", "assistant-content", "all"]
if get_args(Format) != FORMATS or get_args(LossMask) != LOSS_MASKS:     # pragma: no cover
    raise ImportError("fleet.config's Format or LossMask differs from worker.formats' FORMATS or LOSS_MASKS")


class ConfigError(Exception):
    """A user error in fleet.toml: the message is one line naming file:line and the key."""


def parse_duration(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(value))
    if not m:
        raise ValueError(f"not a duration: {value!r} (use e.g. \"120s\", \"2m\", \"1h\")")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def positive_duration(value: Any) -> float:
    d = parse_duration(value)
    if d <= 0:
        raise ValueError("must be positive")
    return d


def split_command(v: str) -> list[str]:
    """A command line as argv (never run by a shell): split like a POSIX shell would."""
    import shlex
    try:
        argv = shlex.split(v)
    except ValueError as e:
        raise ValueError(f"cannot split command: {e}") from None
    if not argv:
        raise ValueError("empty command")
    return argv


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSpec(Strict):
    name: str
    model: str = ""
    data: str = ""
    # One folder, or several on a host's disks (one per NVMe): the first holds the run's records
    # and a link for every sample; the samples' bytes are spread over all of them in turn.
    output: Union[str, list[str]]
    format: Format = "speculators"                # which trainer's files the workers write
    layers: Union[str, list[int], None] = None      # a preset, "from:<draft config.json>", a list; None: the format's
    last_layer_norm: Literal["pre", "post"] | None = None
    target_last_hidden_states: bool = False         # specforge-dflash: add DSpark's final state
    loss_mask: LossMask = "assistant"
    dtype: Literal["bf16", "fp8"] = "bf16"          # hidden states as stored (fp8: format speculators)
    max_tokens_per_batch: int = Field(16384, gt=0)
    max_length: int | None = Field(None, gt=0)
    too_long: Literal["truncate", "skip"] = "skip"
    max_skip_fraction: float = Field(0.01, ge=0, le=1)  # more rows skipped than this fails the shard
    # 1 in N rows (at least 8 a shard) re-computed alone through the model's plain forward and
    # compared with what was written (worker/reference.py); "off": none
    reference_checks: Union[int, Literal["off"]] = 2000
    gpus_per_shard: int = Field(1, ge=1, le=64)         # one shard spans this many GPUs of a host
    compile: Literal["auto", "on", "off"] = "auto"      # torch.compile the decoder layers (auto: GPU, dense)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    extra_args: list[str] = []          # more flags for python -m worker.extract
    env: dict[str, str] = {}            # environment for every shard process
    demo: bool = False                  # make the tiny demo model and dataset on first use
    # Where the output lands (worker/ship.py): s3://bucket/prefix, sftp://[user@]host/path or a path;
    # each host ships its finished files there as the run goes on. None: the output stays on the hosts.
    destination: str | None = None
    keep_local: int | None = None       # with a destination: the most bytes of output a host keeps

    @field_validator("reference_checks")
    @classmethod
    def _reference_checks(cls, v):
        if v != "off" and (isinstance(v, bool) or v < 1):
            raise ValueError('1 in N rows: a whole number from 1, or "off"')
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"bad environment variable name {key!r}")
        return v

    @field_validator("output")
    @classmethod
    def _output(cls, v: str | list[str]) -> str | list[str]:
        paths = [v] if isinstance(v, str) else v
        if not paths or any(not p for p in paths):
            raise ValueError("a folder, or a list of folders (one per disk)")
        if len(set(paths)) < len(paths):
            raise ValueError("a folder listed twice")
        return v

    @field_validator("destination")
    @classmethod
    def _destination(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                destination(v, environ={})
            except ShipError as e:
                raise ValueError(str(e).removeprefix(f"destination {v}: ")) from None
        return v

    @field_validator("keep_local", mode="before")
    @classmethod
    def _keep_local(cls, v):
        if v is None:
            return v
        n = parse_bytes(v)
        if n <= 0:
            raise ValueError("a size above zero")
        return n

    @model_validator(mode="after")
    def _keep_needs_destination(self):
        if self.keep_local is not None and self.destination is None:
            raise ValueError("keep_local bounds what waits to be shipped: set destination too")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("use letters, digits, '.', '_' or '-' (it names folders)")
        return v

    @field_validator("layers", mode="before")
    @classmethod
    def _layer_spec(cls, v):
        if isinstance(v, str):               # the worker's own resolver: the same names, the same refusals
            try:
                check_spec(v)
            except LayerError as e:
                raise ValueError(str(e).removeprefix("layers ")) from None
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        if isinstance(v, list):
            if not v or any(i < 0 for i in v) or len(set(v)) != len(v):
                raise ValueError("a non-empty list of distinct non-negative hs indices")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v, info):
        try:                                 # format is validated first (declared before dtype)
            check_dtype(info.data.get("format", "speculators"), v)
        except FormatError as e:
            raise ValueError(str(e).removeprefix(f"dtype {v}: ")) from None
        return v

    @property
    def layers_arg(self) -> str | None:
        if self.layers is None:
            return None
        return self.layers if isinstance(self.layers, str) else ",".join(map(str, self.layers))


class ExpectedSpec(Strict):
    samples_per_s_per_gpu: float | None = Field(None, gt=0)
    tokens_per_s_per_gpu: float | None = Field(None, gt=0)
    alert_ratio: float = Field(0.8, gt=0, le=1)

    @model_validator(mode="after")
    def _one(self):
        if self.samples_per_s_per_gpu and self.tokens_per_s_per_gpu:
            raise ValueError("give samples_per_s_per_gpu or tokens_per_s_per_gpu, not both")
        return self


class SuperviseSpec(Strict):
    stall_timeout: float = 120.0
    max_restarts: int = Field(3, ge=0)
    backoff_base: float = 2.0
    backoff_max: float = 60.0
    restart_stalled: bool = True
    telemetry_interval: float = 0.25
    connect_timeout: float = 10.0
    keepalive_interval: float = 5.0
    keepalive_count_max: int = Field(3, ge=1)
    reconnect_max: float = 30.0
    max_concurrent_connects: int = Field(8, ge=1)
    stop_grace: float = 10.0             # SIGTERM -> SIGKILL for every stop and restart
    host_lost_after: float | None = 600.0   # unreachable this long: its rows go to the others ("never": kept)

    @field_validator("host_lost_after", mode="before")
    @classmethod
    def _lost_after(cls, v):
        return None if v in ("never", None) else positive_duration(v)

    @field_validator("stall_timeout", "backoff_base", "backoff_max", "telemetry_interval",
                     "connect_timeout", "keepalive_interval", "reconnect_max", "stop_grace", mode="before")
    @classmethod
    def _duration(cls, v):
        return positive_duration(v)


class JobSpec(Strict):
    """A custom command instead of the built-in worker, supervised through log sentinels."""
    command: str
    cwd: str | None = None
    done: str | None = None              # regex over log lines: the job finished well
    fail: str | None = None              # regex over log lines: the job failed
    progress: str | None = None          # regex with (?P<done>\d+) and optionally (?P<total>\d+)
    progress_glob: str | None = None     # output files counted as progress; {shard} allowed
    total: int | None = Field(None, gt=0)  # samples per shard, when progress gives no total
    rows: int | None = Field(None, gt=0, strict=True)   # the run's rows, for a command taking {start}/{end}
    min_chunk: int | None = Field(None, gt=0, strict=True)   # the fewest rows one run of it is given
                                                             # (None: 1% of a shard's)

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        for token in split_command(v):
            for _, field, _, _ in string.Formatter().parse(token):
                if field is not None and field not in PLACEHOLDERS:
                    raise ValueError(f"unknown placeholder {{{field}}}; known: "
                                     f"{', '.join(sorted(PLACEHOLDERS))}")
        return v

    @property
    def row_placeholders(self) -> set[str]:
        return {field for token in split_command(self.command)
                for _, field, _, _ in string.Formatter().parse(token) if field in ROW_PLACEHOLDERS}

    @property
    def takes_rows(self) -> bool:
        """The command names its rows ({start}/{end}): it is run once per chunk of its leases."""
        return bool(self.row_placeholders)

    @model_validator(mode="after")
    def _rows(self):
        if self.takes_rows and self.row_placeholders != ROW_PLACEHOLDERS:
            missing = (ROW_PLACEHOLDERS - self.row_placeholders).pop()
            raise ValueError(f"command takes {{{(self.row_placeholders).pop()}}} but not {{{missing}}}: "
                             "a run of it is given rows [start, end) and must be told both")
        if self.min_chunk is not None and not self.takes_rows:
            raise ValueError("min_chunk is for a command taking {start}/{end}, and this one takes neither")
        if self.min_chunk is not None and self.rows is not None and self.min_chunk > self.rows:
            raise ValueError(f"min_chunk = {self.min_chunk} is more than rows = {self.rows}")
        if self.takes_rows and self.rows is None:
            raise ValueError("command takes {start}/{end}: give rows = the run's number of rows "
                             "(each run of the command gets rows [start, end) of them)")
        if self.rows is not None and not self.takes_rows:
            raise ValueError("rows is for a command taking {start}/{end}, and this one takes neither")
        if self.takes_rows and (self.progress_glob or self.total):
            raise ValueError("a command taking {start}/{end} is counted by the rows it finishes: "
                             "leave out progress_glob and total (a progress line still counts within a run)")
        return self

    @field_validator("done", "fail", "progress")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"bad regex: {e}") from None
        return v


class HostSpec(Strict):
    """One SSH box. `address` may be a Host alias of the OpenSSH config (`ssh_config`, default
    ~/.ssh/config): what this entry leaves out (port, user, identity_file, known_hosts) comes from
    the alias as `ssh` would take it, and what it sets wins (fleet/transport.py resolves it)."""
    name: str
    address: str
    port: int | None = Field(None, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_new: bool = False
    ssh_config: str | None = None
    python: str | None = None
    gpus: Union[Literal["all"], list[int]] = "all"
    root: str = "fleet"
    usd_per_hour: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)   # what the box costs a hour

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not NAME_RE.fullmatch(v):
            raise ValueError("use letters, digits, '.', '_' or '-'")
        return v

    @field_validator("address", "user")
    @classmethod
    def _no_option(cls, v):
        if v is not None and (not v or v.startswith("-") or any(c.isspace() for c in v)):
            raise ValueError("must not be empty, start with '-' or hold spaces")
        if v is not None and printable(v) != v:
            raise ValueError("holds a control or bidirectional character")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v):
        if isinstance(v, list) and (not v or any(g < 0 for g in v) or len(set(v)) != len(v)):
            raise ValueError("\"all\" or a non-empty list of distinct GPU indices")
        return v

    @field_validator("ssh_config")
    @classmethod
    def _ssh_config(cls, v):
        if v is not None and not os.path.isfile(os.path.expanduser(v)):
            raise ValueError(f"{v}: no such file (an OpenSSH client config, like ~/.ssh/config)")
        return v

    @property
    def is_local(self) -> bool:
        return self.address == "local"


SLURM_TIME_RE = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|"
                           r"\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE")
# sbatch options fleet sets itself: one task per shard, its log in the shard's folder, no requeue
# behind fleet's back (a restart is fleet's, under the restart policy).
# fleet.toml sections that name an engine of tasks, in the order they are looked for (none: [[hosts]]).
TASK_ENGINES = ("slurm", "ray")
SBATCH_OWN = ("-a", "--array", "-o", "--output", "-e", "--error", "-J", "--job-name", "--open-mode",
              "--requeue", "--no-requeue", "--parsable", "--wrap", "-n", "--ntasks", "-N", "--nodes")


class TaskEngineSpec(Strict):
    """What every engine that queues shards as tasks takes ([slurm], [ray]): the login (or head)
    node fleet deploys to, submits from and runs the agent on, and the run's records on a
    filesystem every node sees."""
    login: str = "local"                 # "[user@]host" reached over SSH, or "local" (fleet runs there)
    port: int | None = Field(None, ge=1, le=65535)   # left out: as for [[hosts]], from ~/.ssh/config
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_new: bool = False
    root: str = "fleet"                  # on a filesystem every node sees (records, code, logs)
    python: str | None = None            # as the nodes see it (a shared venv)
    shards: int = Field(gt=0)
    job_name: str | None = None          # default "fleet-<run name>"
    poll_interval: float = 5.0           # how often the engine is asked about the tasks

    @field_validator("login")
    @classmethod
    def _login(cls, v: str) -> str:
        if not v or v.startswith("-") or any(c.isspace() for c in v) or v.count("@") > 1 or v.endswith("@"):
            raise ValueError('"local" or [user@]host (no spaces, not starting with "-")')
        return v

    @field_validator("job_name")
    @classmethod
    def _word(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._,:-]*", v):
            raise ValueError("letters, digits and . _ , : - only")
        return v

    @field_validator("poll_interval", mode="before")
    @classmethod
    def _duration(cls, v):
        return positive_duration(v)

    def login_host(self, name: str) -> "HostSpec":
        """The login node as a host named `name`: where fleet deploys, submits, and runs the agent."""
        user, _, address = self.login.rpartition("@")
        return HostSpec(name=name, address=address, port=self.port, user=user or None,
                        identity_file=self.identity_file, known_hosts=self.known_hosts,
                        accept_new=self.accept_new, python=self.python, gpus=[0], root=self.root)

    def host_options(self) -> dict:
        """What the engine's host side (worker/engine/) is told of this section."""
        return {}


class SlurmSpec(TaskEngineSpec):
    """Slurm as the launcher: one array task per shard, submitted and watched from the login node."""
    partition: str | None = None
    account: str | None = None
    time: str | None = None              # the task's time limit, as sbatch --time takes it
    gpus_per_task: int | None = Field(None, ge=0)  # --gres=gpu:N (0: CPU-only; None: [run] gpus_per_shard)
    max_parallel: int | None = Field(None, gt=0)   # the array's %N throttle
    sbatch_args: list[str] = []

    @field_validator("partition", "account")
    @classmethod
    def _slurm_word(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._,:-]*", v):
            raise ValueError("letters, digits and . _ , : - only")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v):
        if v is not None and not SLURM_TIME_RE.fullmatch(v):
            raise ValueError(f"not a Slurm time limit: {v!r} (e.g. \"12:00:00\", \"2-00:00:00\", \"90\")")
        return v

    @field_validator("sbatch_args")
    @classmethod
    def _sbatch_args(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not arg.startswith("-"):
                raise ValueError(f"{arg!r}: give each option as one item, e.g. \"--qos=normal\"")
            name = arg.split("=", 1)[0]
            if name in SBATCH_OWN or (len(name) > 2 and not name.startswith("--") and name[:2] in SBATCH_OWN):
                raise ValueError(f"{arg!r}: fleet sets {name} itself (one task per shard, its log "
                                 f"in the shard's folder, restarts under the restart policy)")
        return v

    def host_options(self) -> dict:
        return {"partition": self.partition, "account": self.account}


class RaySpec(TaskEngineSpec):
    """A Ray cluster as the launcher: one actor per shard, created and watched from a node of the
    cluster (`login`: the head node, or any node with the cluster's address)."""
    address: str = "auto"                # the cluster's GCS address (host:port), or "auto" (the login node's)
    namespace: str = "fleet"             # the Ray namespace fleet's actors live in
    num_gpus: float | None = Field(None, ge=0)   # each shard's actor's GPUs (None: [run] gpus_per_shard; 0: CPU-only)
    num_cpus: float = Field(1.0, ge=0)   # what each shard's actor asks for beside its GPUs
    resources: dict[str, float] = {}     # custom resources each shard's actor asks for
    runtime_env: dict | None = None      # Ray's runtime_env for the actors (env_vars, ...), as Ray takes it
    dashboard: str | None = None         # the state API's address (http://head:8265); default: Ray's own

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v != "auto" and not re.fullmatch(r"[A-Za-z0-9._-]+:\d+", v):
            raise ValueError('"auto" or host:port of the cluster\'s GCS (e.g. "10.0.0.1:6379")')
        return v

    def host_options(self) -> dict:
        return {"address": self.address, "namespace": self.namespace, "dashboard": self.dashboard}


NotifyEvent = Literal["PENDING", "STARTING", "LOADING", "RUNNING", "LATE", "DONE", "STALLED", "FAILED", "BACKOFF",
                      "FATAL", "STOPPED", "UNKNOWN", "alert", "finished"]
NOTIFY_EVENTS = get_args(NotifyEvent)


class NotifySpec(Strict):
    """A command the supervisor runs (split like [job] commands, never by a shell) on chosen
    transitions, with the event as JSON on its stdin (fleet/notify.py)."""
    command: str
    on: list[NotifyEvent] = ["FAILED", "FATAL", "alert", "finished"]
    alert_after: float = 120.0          # throughput under alert_ratio this long before "alert"
    timeout: float = 30.0

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        import shutil
        argv = split_command(v)
        program = os.path.expanduser(argv[0])
        relative = "/" in program and not os.path.isabs(program)     # to fleet.toml's folder: run there
        if not relative and shutil.which(program) is None:           # it runs here, by the supervisor
            raise ValueError(f"{argv[0]}: not found here, or not executable")
        return v

    @field_validator("alert_after", "timeout", mode="before")
    @classmethod
    def _duration(cls, v):
        d = parse_duration(v)
        if d < 0:
            raise ValueError("must not be negative")
        return d

    @property
    def argv(self) -> list[str]:
        import shlex
        return shlex.split(self.command)


class FleetSpec(Strict):
    run: RunSpec
    expected: ExpectedSpec = ExpectedSpec()
    supervise: SuperviseSpec = SuperviseSpec()
    job: JobSpec | None = None
    notify: NotifySpec | None = None
    hosts: list[HostSpec] = []
    slurm: SlurmSpec | None = None
    ray: RaySpec | None = None

    @model_validator(mode="after")
    def _checks(self):
        if not self.hosts and self.slurm is None and self.ray is None:
            raise ValueError("hosts: required key missing: give [[hosts]] (SSH boxes), a [slurm] or a [ray] section")
        names = [h.name for h in self.hosts]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate host name {sorted(dup)[0]!r}")
        if self.job is None and not (self.run.model and self.run.data):
            raise ValueError("[run] needs model and data (or a [job] section with a custom command)")
        if self.job is not None and self.run.destination is not None:
            raise ValueError("[run] destination ships the built-in worker's files; a [job] writes its own "
                             "(copy them from its command)")
        return self


class Config:
    """A validated FleetSpec plus where it came from (for resolving local paths)."""

    def __init__(self, spec: FleetSpec, path: str):
        self.spec = spec
        self.path = os.path.abspath(path)
        self.base_dir = os.path.dirname(self.path)

    @property
    def run(self) -> RunSpec:
        return self.spec.run

    @property
    def engine(self) -> str:
        """Which engine runs the shards: the engine section present, else "hosts" ([[hosts]])."""
        return next((name for name in TASK_ENGINES if getattr(self.spec, name) is not None), "hosts")

    @property
    def tasks(self) -> TaskEngineSpec | None:
        """The engine of tasks' section ([slurm], [ray]); None for [[hosts]]."""
        return getattr(self.spec, self.engine, None) if self.engine != "hosts" else None

    @property
    def hosts(self) -> list[HostSpec]:
        """The hosts fleet talks to: the [[hosts]], or an engine of tasks' login node (named as
        the engine: "slurm", "ray")."""
        if self.tasks is not None:
            return [self.tasks.login_host(self.engine)]
        return self.spec.hosts

    @property
    def slurm(self) -> SlurmSpec | None:
        return self.spec.slurm

    @property
    def ray(self) -> RaySpec | None:
        return self.spec.ray

    @property
    def job_name(self) -> str:
        return (self.tasks and self.tasks.job_name) or f"fleet-{self.run.name}"

    def host_path(self, host: HostSpec, path: str) -> str:
        """A [run]/root path as the host sees it: local relative paths from fleet.toml's folder."""
        if host.is_local:
            return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(path)))
        return path

    def output_dirs(self, host: HostSpec) -> list[str]:
        """[run] output as `host` sees it, each folder; "{host}" in one is the host's name (one
        folder a host on storage several hosts mount). The first is the output folder."""
        paths = [self.run.output] if isinstance(self.run.output, str) else self.run.output
        return [self.host_path(host, p.replace("{host}", host.name)) for p in paths]

    def output_dir(self, host: HostSpec) -> str:
        """The host's output folder: its records, and every sample (or a link to it on another disk)."""
        return self.output_dirs(host)[0]

    def destination(self, host: HostSpec) -> str | None:
        """[run] destination as `host` gives it to rclone: a URL as written, a path as host_path."""
        d = self.run.destination
        if d is None or destination(d, environ={}).is_store:
            return d
        return self.host_path(host, d)

    def run_dir(self, host: HostSpec) -> str:
        return os.path.join(self.host_path(host, host.root), self.run.name)

    def python(self, host: HostSpec) -> str:
        return host.python or (sys.executable if host.is_local else "python3")


# --- loading with located errors ---------------------------------------------------------------

def _key_lines(text: str) -> dict[tuple, int]:
    """Map key paths like ('hosts', 1, 'port') and table paths to 1-based line numbers."""
    lines: dict[tuple, int] = {}
    table: tuple = ()
    counts: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if m := re.match(r"^\[\[\s*([A-Za-z0-9_.-]+)\s*\]\]", line):
            name = m.group(1)
            counts[name] = counts.get(name, -1) + 1
            table = (name, counts[name])
            lines.setdefault(table, n)
            lines.setdefault((name,), n)
        elif m := re.match(r"^\[\s*([A-Za-z0-9_.-]+)\s*\]", line):
            table = tuple(m.group(1).split("."))
            lines.setdefault(table, n)
        elif m := re.match(r"^([A-Za-z0-9_-]+|\"[^\"]*\")\s*=", line):
            lines.setdefault(table + (m.group(1).strip('"'),), n)
    return lines


def _locate(lines: dict[tuple, int], loc: tuple) -> int | None:
    loc = tuple(x for x in loc if not (isinstance(x, str) and x in ("list[int]", "literal['all']",
                                                                      "str", "function-after")))
    for cut in range(len(loc), 0, -1):
        if loc[:cut] in lines:
            return lines[loc[:cut]]
    return None


def _section_name(loc: tuple) -> str:
    if not loc:
        return "the top level"
    if len(loc) >= 2 and isinstance(loc[1], int):
        return f"[[{loc[0]}]] #{loc[1] + 1}"
    return f"[{'.'.join(str(x) for x in loc)}]"


_MODELS: dict[str, type[BaseModel]] = {
    "run": RunSpec, "expected": ExpectedSpec, "supervise": SuperviseSpec, "job": JobSpec, "hosts": HostSpec,
    "slurm": SlurmSpec, "ray": RaySpec, "notify": NotifySpec, "": FleetSpec}


def _format_error(err: ErrorDetails, lines: dict[tuple, int], path: str) -> str:
    loc = tuple(err["loc"])
    clean = tuple(x for x in loc if isinstance(x, int) or x in lines or not x.startswith(("literal", "list")))
    line = _locate(lines, clean)
    where = f"{path}:{line}" if line else path
    keypath = (f"{_section_name(clean[:2])} {'.'.join(str(x) for x in clean[2:])}"
               if len(clean) > 2 and isinstance(clean[1], int)
               else ".".join(str(x) for x in clean) or "(top level)")
    if err["type"] == "extra_forbidden":
        key = str(clean[-1])
        parent = clean[:-1]
        model = _MODELS.get(str(parent[0]) if parent else "", FleetSpec)
        if key == "password":
            return (f"{where}: {keypath}: passwords are not accepted in fleet.toml; use "
                    f"identity_file or the SSH agent")
        fields = list(model.model_fields)
        hint = [f for f in fields if sorted(f) == sorted(key)] or \
            difflib.get_close_matches(key, fields, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        return f"{where}: unknown key {key!r} in {_section_name(parent)}{suggestion}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"{where}: {keypath}: required key missing"
    return f"{where}: {keypath}: {msg}"


def load_config(path: str) -> Config:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (give one with -c/--config)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (byte {e.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        where = f"{path}:{m.group(1)}" if m else path
        raise ConfigError(f"{where}: invalid TOML: {msg}") from None
    given = [name for name in TASK_ENGINES if isinstance(data.get(name), dict)] + (["hosts"] if "hosts" in data else [])
    if len(given) > 1:
        lines = _key_lines(text)
        line = lines.get((given[0],)) or lines.get((given[1],))
        names = " and ".join("[[hosts]]" if g == "hosts" else f"[{g}]" for g in given)
        raise ConfigError(f"{path}:{line}: {names} are alternatives: an engine ([slurm], [ray]) places "
                          f"the shards on its nodes, [[hosts]] are SSH boxes fleet launches on; "
                          f"keep one of them")
    try:
        spec = FleetSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise ConfigError(_format_error(first, _key_lines(text), path)) from None
    n, k = (spec.slurm.gpus_per_task if spec.slurm else None), spec.run.gpus_per_shard
    if n and n != k:                     # a task runs one shard: it gets exactly the shard's GPUs
        line = _key_lines(text).get(("slurm", "gpus_per_task"))
        raise ConfigError(f"{path}:{line}: slurm.gpus_per_task = {n}, but [run] gpus_per_shard = {k}: "
                          f"each array task runs one shard on its own GPUs; leave gpus_per_task out "
                          f"(it follows gpus_per_shard) or make them equal")
    return Config(spec, path)
