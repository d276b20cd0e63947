"""The typed replies of host commands: what a host command prints, one JSON object, the last line of
its stdout, and the typed parts records carry (a plan, GPU readings, the work's identity, the
run's claim).

Written by the host side through these classes (`to_dict`) and parsed once where they arrive in
fleet (`from_dict`, through fleet.deploy.run_worker_module's `reply=`): a reply that is not one
of these is an error naming the host there, never a KeyError later. Every field has a default,
so a reply from an older or newer worker still parses; unknown keys are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .records import CompactReply, Reply


@dataclass
class Status(Reply):
    """What a host command that only does one thing did (`hostctl reopen`: reopened | running;
    `worker.relocate`: adopted | already | revoked | error, with `detail`)."""
    status: str = ""
    detail: str = ""


@dataclass
class SupervisorClaim(CompactReply):
    """Who supervises the run: written by its agent into `<run dir>/supervisor.json` while it holds
    the run's claim (`supervisor.lock`), and handed to an agent of another supervisor as the
    reason it refuses (`Claimed`)."""
    id: str = ""                # machine:pid:start of the supervisor
    run: str = ""
    machine: str = ""
    user: str = ""
    pid: int = 0
    started: float = 0.0
    config: str = ""            # its fleet.toml, on its machine
    socket: str = ""            # its control socket, on its machine
    agent_pid: Optional[int] = None


@dataclass
class Unfinished(Reply):
    """`worker.relocate pending`: the rows of a host's pool not yet done (held, free, less every
    row a manifest there records), which a host whose every GPU has given up gives to the others."""
    runs: list[list[int]] = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class GpuStat(CompactReply):
    """One GPU as telemetry read it (worker/gpu.py); None where a reading is not available."""
    index: int = 0
    name: Optional[str] = None
    uuid: Optional[str] = None
    mem_used: Optional[int] = None     # bytes
    mem_total: Optional[int] = None
    util: Optional[float] = None       # percent
    temp: Optional[float] = None       # degrees C
    power_w: Optional[float] = None
    power_limit_w: Optional[float] = None
    lost: Optional[bool] = None        # NVML lost it: listed, with no readings


@dataclass
class ModelIdentity(CompactReply):
    """What a model folder is (worker.identity.model_identity): hashes of its config and of its
    weight files' names, sizes and edges; `path` is recorded, never compared."""
    config: str = ""
    weights: str = ""
    path: Optional[str] = None


@dataclass
class DataIdentity(CompactReply):
    """What a dataset is (worker.identity.dataset_identity): its rows, bytes, edge rows' and
    content's hashes; `path` and `mtime` are recorded, never compared."""
    rows: int = 0
    bytes: int = 0
    first_row: str = ""
    last_row: str = ""
    content: Optional[str] = None      # absent from plans written before it was recorded
    path: Optional[str] = None
    mtime: Optional[float] = None


@dataclass
class WorkIdentity(CompactReply):
    """The identity of a run's work (worker.identity.work_identity): its model, its data and what
    is written. Kept in plan.json and meta.json and compared key by key (identity.differences):
    what an older record lacks is not compared."""
    model: Optional[ModelIdentity] = None
    data: Optional[DataIdentity] = None
    layer_ids: Optional[list[int]] = None
    last_layer_norm: Optional[str] = None
    target_last: Optional[bool] = None
    format: Optional[str] = None
    loss_mask: Optional[str] = None
    dtype: Optional[str] = None


@dataclass
class Check(Reply):
    """One finding of a host check: level error (refuses the host) | warning."""
    level: str = "error"
    message: str = ""


@dataclass
class PlanShard(Reply):
    id: int = 0
    host: str = ""
    gpu: int = 0
    gpus: list[int] = field(default_factory=list)


@dataclass
class Plan(Reply):
    """The run's plan (`<root>/<run>/plan.json`, worker/plan.py; made by fleet/plan.py): the shard
    layout, the fleet.toml values the work depends on (`spec`), the identity of the work
    (worker.identity), each host name's machine (`host_ids`), `launcher` the engine that queues its tasks, or None."""
    version: int = 0
    run: str = ""
    created: float = 0.0
    num_shards: int = 0
    shards: list[PlanShard] = field(default_factory=list)
    spec: dict = field(default_factory=dict)
    identity: WorkIdentity = field(default_factory=WorkIdentity)
    host_ids: dict[str, str] = field(default_factory=dict)
    launcher: Optional[str] = None


@dataclass
class Footprint(Reply):
    """The output's projected size (worker.preflight.footprint): the whole run's, and what is still
    to write in row buckets [edges[j], edges[j+1]) (fleet/footprint.py sums a host's shards')."""
    rows: int = 0
    tokens: int = 0
    exact: bool = False
    basis: str = ""
    dtype: str = "bf16"
    layers: int = 0
    hidden_size: int = 0
    bytes_per_token: int = 0
    bytes_per_file: int = 0
    total_bytes: int = 0
    written_bytes: int = 0
    edges: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    bytes_per_token_fp8: Optional[int] = None    # what dtype = "fp8" would take (bf16 speculators)


@dataclass
class EngineCheck(Reply):
    """`python -m worker.engine.<name> check` on the engine's login node."""
    checks: list[Check] = field(default_factory=list)
    version: Optional[str] = None                # the engine's, as it says it
    accounting: Optional[bool] = None            # whether it keeps ended tasks' final states


@dataclass
class PreflightReport(Reply):
    """`python -m worker.preflight`: what a host has and whether it can run its shards."""
    python: str = ""
    checks: list[Check] = field(default_factory=list)
    telemetry: str = "none"                      # nvml | nvidia-smi | none
    torch: Optional[str] = None
    cuda_devices: Optional[int] = None
    gpu_count: int = 0
    gpus: list[int] = field(default_factory=list)   # the GPU indices its shards will use
    gpu_uuids: list[str] = field(default_factory=list)   # theirs, where telemetry reads them (which card)
    plan: Optional[Plan] = None                  # the run's plan on this host, if it has one
    host_id: Optional[str] = None                # which machine this is (<root>/host-id)
    identity: WorkIdentity = field(default_factory=WorkIdentity)   # what its model and data are
    free_bytes: Optional[int] = None             # free at the output
    folder_id: Optional[str] = None              # the output folder's id (its meta.json)
    footprint: Optional[Footprint] = None
    estimated_bytes: Optional[int] = None        # still to write for the whole run
    uplink_bps: Optional[float] = None           # measured upload to the run's destination
    write_bps: Optional[float] = None            # measured write rate of the output disks (worker.probe)
    engine: Optional[EngineCheck] = None         # an engine's check of its login node (fleet adds it)

    @property
    def errors(self) -> list[str]:
        return [c.message for c in self.checks if c.level == "error"]

    @property
    def warnings(self) -> list[str]:
        return [c.message for c in self.checks if c.level != "error"]


@dataclass
class Repair(Reply):
    """What `worker.verify --repair` did to a folder."""
    dropped: list[int] = field(default_factory=list)
    deduplicated: list[int] = field(default_factory=list)
    removed_files: int = 0
    retried_skips: list[int] = field(default_factory=list)
    moved_away: list[int] = field(default_factory=list)   # copies of rows another host holds now
    restored: list[int] = field(default_factory=list)     # rows given to a host that never took them: back
    reshipped: list[int] = field(default_factory=list)    # whole here, wrong or missing at the destination:
                                                          # the next launch ships them again


@dataclass
class VerifyReport(Reply):
    """`python -m worker.verify`: one output folder checked. `written`: half-open runs of indices
    (worker.ranges); `skipped`: index (as a string, JSON's keys) -> reason."""
    num_samples: Optional[int] = None
    format: Optional[str] = None
    dtype: Optional[str] = None
    checked: int = 0
    folder_id: Optional[str] = None
    repaired: Optional[Repair] = None
    written: list[list[int]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unrecorded_files: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: Optional[str] = None                # the command that trains on the folder
    away: dict[str, list[list[int]]] = field(default_factory=dict)   # host -> runs here its ledger says moved there
    broken: list[list[int]] = field(default_factory=list)            # runs of rows whose file here is wrong
    strays: list[list[int]] = field(default_factory=list)            # files no manifest records, of moved rows
    owner: Optional[str] = None                  # the run its owner record (.fleet/owner.json) names
    checked_rows: int = 0                        # rows re-computed by the reference forward (worker/reference.py)
    layer_ids: list[int] = field(default_factory=list)
    worst_cosine: list[float] = field(default_factory=list)   # per saved layer, over those rows


@dataclass
class ExportSummary(Reply):
    """`python -m worker.export`: what one host's export did."""
    source: str = ""
    out: str = ""
    format: str = ""
    dtype: str = ""
    to_do: int = 0
    written: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Submission(Reply):
    """`python -m worker.engine.<name> submit`: status submitted | held (every shard still live) | error;
    `shards`: shard -> submitted | refused (recorded as failed) | held (its task is live)."""
    status: str = "error"
    job: Optional[str] = None
    argv: Optional[str] = None
    error: Optional[str] = None
    shards: dict[str, str] = field(default_factory=dict)


@dataclass
class Cancellation(Reply):
    """`python -m worker.engine.<name> cancel` (one shard: `status` not running | stopped | cancelling |
    error) and `cancel-all` (`shards`: shard -> not running | stopped | cancelling)."""
    status: str = "error"
    job: Optional[str] = None
    state: Optional[str] = None                  # the engine's state of the task at the end
    error: Optional[str] = None
    shards: dict[str, str] = field(default_factory=dict)
