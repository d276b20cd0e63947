"""The shape of a snapshot: what `fleet status --json` prints and the live view draws, as pydantic
models (the JSON schema is generated from them: `json_schema`). Only the shape: every figure in it
is computed by fleet/snapshot.py, from the store's records."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from .state import State

SCHEMA = "fleet.status/3"

AlertLevel = Literal["ok", "low", "critical"]


class Gpu(BaseModel):
    index: int
    name: Optional[str] = None
    uuid: Optional[str] = None
    mem_used: Optional[int] = Field(None, description="bytes")
    mem_total: Optional[int] = Field(None, description="bytes")
    util: Optional[float] = Field(None, description="percent")
    temp: Optional[float] = Field(None, description="degrees C")
    power_w: Optional[float] = None
    power_limit_w: Optional[float] = Field(None, description="the enforced power limit, when reported")
    lost: bool = Field(False, description="NVML lost the GPU: it stays listed, with no readings")


class Disk(BaseModel):
    path: str
    free: Optional[int] = Field(None, description="bytes available at the output folder")
    total: Optional[int] = None
    error: Optional[str] = None


class GpuTotals(BaseModel):
    """A host's GPUs summed up (the ones NVML still sees): what its one row in the live view shows."""
    count: int = Field(description="GPUs listed, lost ones included")
    lost: int = 0
    mem_used: int = Field(0, description="bytes, over the GPUs not lost")
    mem_total: int = 0
    util: Optional[float] = Field(None, description="mean percent over the GPUs that report it")
    temp_max: Optional[float] = None
    power_w: float = 0.0


class ReferenceStatus(BaseModel):
    """Rows re-computed alone through the model's plain forward and compared with what was written
    (worker/reference.py; [run] reference_checks)."""
    rows: int = Field(0, description="rows checked")
    layer_ids: list[int] = Field(default_factory=list, description="the saved layers, as hs indices")
    worst_cosine: list[float] = Field(default_factory=list, description="per layer, the lowest cosine")
    worst_rel_err: list[float] = Field(default_factory=list, description="per layer, the largest relative error")
    masks: int = Field(0, description="of the rows checked, raw chats whose loss mask was checked against the "
                                      "chat template's rendering")
    failed: Optional[str] = Field(None, description="the check that failed (the shard stopped for it)")

    @property
    def text(self) -> str:
        """'checked 24 rows ✓ (worst cosine 0.9996, layer 32; 24 masks)', or what failed."""
        if self.failed:
            return f"check failed: {self.failed}"
        masks = f"; {self.masks} masks" if self.masks else ""
        if not self.worst_cosine:
            return f"checked {self.rows} rows" + (f" ({masks[2:]})" if masks else "")
        k = min(range(len(self.worst_cosine)), key=lambda j: self.worst_cosine[j])
        layer = self.layer_ids[k] if k < len(self.layer_ids) else k
        return f"checked {self.rows} rows ✓ (worst cosine {self.worst_cosine[k]:.4f}, layer {layer}{masks})"


class ShippingStatus(BaseModel):
    """Output against the run's destination ([run] destination; worker/ship.py)."""
    destination: str
    shipped_files: int = Field(0, description="files the destination holds, checksum matched (gone from the host)")
    shipped_bytes: int = 0
    pending_files: int = Field(0, description="written files still on the host's disk, to be shipped")
    pending_bytes: int = 0
    rate_bps: Optional[float] = Field(None, description="bytes a second over the last transfer(s) of the "
                                                        "last 30 s; null when none moved lately")
    waiting: bool = Field(False, description="a writer waits for shipping (keep_local reached)")
    error: Optional[str] = Field(None, description="the last transfer's failure (retried; never a failure "
                                                   "of the shard)")
    finished: bool = Field(False, description="every file is at the destination (the shards are DONE)")


class Bound(BaseModel):
    """What sets the pace (fleet/bound.py): the GPUs themselves, or the disk or the upload they
    wait for, from the workers' own counts of their waits."""
    by: Literal["gpu", "disk", "upload"] = Field(description="gpu: the GPUs waited under 5% of the time; "
                                                 "disk: they waited on the writer writing; upload: on "
                                                 "the writer waiting for shipping (keep_local full)")
    gpu_waited: float = Field(description="the share of the GPUs' batch time they waited for the writer (0-1)")
    seconds: float = Field(description="the GPU-seconds it is over: each running shard's last minute while "
                                       "the run goes, every batch once it is finished")

    @property
    def label(self) -> str:
        """The bound as people read it: GPU, disk or upload."""
        return "GPU" if self.by == "gpu" else self.by

    @property
    def text(self) -> str:
        """'bound by disk: GPUs waited 23%' (or 'bound by GPU: GPUs waited 1%')."""
        return f"bound by {self.label}: GPUs waited {self.gpu_waited:.0%}"


class HostStatus(BaseModel):
    name: str
    address: str
    role: Optional[Literal["login", "node"]] = Field(None, description="with an engine of tasks: the login "
                                                     "(or head) node fleet submits from (named as the "
                                                     "engine), or a node its tasks run on (GPUs as they "
                                                     "report them); null for [[hosts]]")
    reachable: Optional[bool] = Field(None, description="false: unreachable (then gpus and disk are "
                                                        "null, not zero); null: not tried yet")
    error: Optional[str] = Field(None, description="why it is unreachable, or the agent's last error")
    unusable: bool = Field(False, description="reached, but its python or the agent fails there "
                                              "(reachable is false then too)")
    telemetry: Optional[Literal["nvml", "nvidia-smi", "none"]] = None
    gpus: Optional[list[Gpu]] = None
    gpu_totals: Optional[GpuTotals] = None
    gpu_age_s: Optional[float] = None
    disk: Optional[Disk] = None
    last_seen_age_s: Optional[float] = None
    replayed: bool = Field(False, description="this host's record has been read since (re)connecting; "
                                              "until then its shards' states are not yet known")
    usd_per_hour: Optional[float] = Field(None, description="[[hosts]] usd_per_hour, when given")
    usd_spent: Optional[float] = Field(None, description="usd_per_hour x the run's elapsed_s")
    shipping: Optional[ShippingStatus] = Field(None, description="its shards' output against the "
                                                                 "destination, summed; null without one")
    catching_up: bool = Field(False, description="the supervisor is reading this host's lines behind "
                                                 "(it was stopped or starved): nothing is decided for its "
                                                 "shards until they are read up to now")
    behind_s: Optional[float] = Field(None, description="how old the newest line read was, while catching up")
    bound: Optional[Bound] = Field(None, description="what sets its pace now: its GPUs, or the disk or upload "
                                                     "they wait for; null while too little is known (or for "
                                                     "a [job])")


class TaskStatus(BaseModel):
    job: Optional[str] = Field(None, description="the task, in its engine's naming (an array task "
                                                 "\"<array job id>_<index>\", an actor's id)")
    phase: Optional[Literal["queued", "running", "ending", "ended"]] = Field(
        None, description="where the task is, in every engine's words")
    state: Optional[str] = Field(None, description="the engine's own state now (PENDING, RUNNING, ALIVE, "
                                                   "...), or its final one as recorded (CANCELLED, TIMEOUT, DEAD)")
    reason: Optional[str] = Field(None, description="the engine's reason (Priority, Resources, ...)")
    node: Optional[str] = None


class ShardStatus(BaseModel):
    id: int
    host: str = Field(description="where it runs or ran; with an engine of tasks its node once "
                                  "started, its engine's name (its fleet.toml section) before")
    gpu: int
    gpus: list[int] = Field(default_factory=list, description="every GPU of the shard (gpus_per_shard)")
    task: Optional[TaskStatus] = Field(None, description="with an engine of tasks: its newest launch's task")
    state: State
    reason: Optional[str] = Field(None, description="why it is in this state (failures, stops)")
    faulty: bool = Field(False, description="STALLED, FAILED, BACKOFF, FATAL or UNKNOWN")
    done: int = 0
    skipped: int = 0
    total: int = 0
    progress: Optional[float] = Field(None, description="the share of the shard's work done: in tokens "
                                                        "once total_tokens is known (as its ETA), else "
                                                        "(done + skipped) / total; 1 when DONE")
    tokens: Optional[int] = Field(None, description="tokens extracted so far; null for a shard that "
                                                    "counts samples only (a [job]) or has counted none yet")
    total_tokens: Optional[int] = Field(None, description="tokens of every row of the shard the worker "
                                                          "will extract (done or not), sent once it has "
                                                          "read their lengths; null until then and for "
                                                          "a [job]")
    bytes: Optional[int] = Field(None, description="bytes written so far; null where not measured (a [job])")
    samples_per_s: Optional[float] = Field(None, description="over the attempt's completed batches "
                                                             "of the last 30 s or more (never 0 between "
                                                             "two slow batches; decaying once the next is "
                                                             "later than usual, 0 after 30 s and 4 usual "
                                                             "intervals with none); null unless RUNNING or "
                                                             "STALLED: a restarted shard starts from no rate")
    tokens_per_s: Optional[float] = None
    eta_s: Optional[float] = Field(None, description="this shard's remaining work at its own pace: a "
                                                     "per-sample and a per-token cost fitted over its "
                                                     "progress since warm-up (minutes, not the last "
                                                     "window's rate); 0 when DONE; null when not "
                                                     "measured")
    eta_rough: bool = Field(False, description="the pace behind eta_s spans under 3 minutes (shown '~')")
    progress_age_s: Optional[float] = Field(None, description="seconds since the live attempt's last "
                                                              "progress (or its launch), host clock")
    progress_interval_s: Optional[float] = Field(None, description="the attempt's usual interval between "
                                                                   "progress events (median)")
    progress_late: bool = Field(False, description="progress_age_s over 3 usual intervals and 10 s: a "
                                                   "stall in the making, long before stall_timeout (a "
                                                   "running shard's state is LATE)")
    restarts: int = Field(0, description="launches after the first")
    auto_attempts: int = Field(0, description="automatic restarts since the last manual launch "
                                              "(FATAL once it reaches max_restarts)")
    max_restarts: int = 0
    failures: int = Field(0, description="attempts that ended in failure, ever")
    last_failure: Optional[str] = None
    alive: Optional[bool] = None
    pid: Optional[int] = None
    exit_code: Optional[int] = None
    last_event: Optional[str] = None
    last_event_age_s: Optional[float] = None
    backoff_s: Optional[float] = Field(None, description="seconds until a pending restart")
    writer_wait_s: float = 0.0
    gpu_mem_bytes: Optional[int] = None
    warning: Optional[str] = None
    record_problem: Optional[str] = Field(None, description="what of its record (events.jsonl) could not "
                                                           "be read: its state is judged from the rest")
    over_total: bool = Field(False, description="its progress counts more than its total: what it counts "
                                                "(a [job]'s progress or files) is not only its own")
    reference: Optional[ReferenceStatus] = Field(None, description="its rows checked against the model's plain "
                                                                   "forward; null before any (or with none)")
    detail: Optional[str] = Field(None, description="what LOADING is doing now (\"compiling the decoder layers\")")
    path: Optional[str] = Field(None, description="the worker's forward path and why (compiled, eager)")
    lease: Optional[str] = Field(None, description="the rows it holds and how it got them: its planned "
                                                   "range, or taken from a dead or a slower shard of its host")
    rows_moved_in: int = Field(0, description="unfinished rows it took from other shards of its host")
    rows_moved_out: int = Field(0, description="unfinished rows other shards of its host took from it")
    holds_rows: bool = Field(True, description="false once its rows went to other shards (a FATAL shard "
                                               "that holds none does not keep the run from finishing)")
    shipping: Optional[ShippingStatus] = Field(None, description="its files against the destination; "
                                                                 "null without one")


class RunCounts(BaseModel):
    """Shards by state, samples and tokens done, bytes, and the GPUs planned and expected to work. One part of Totals (snapshot.py makes each)."""
    model_config = ConfigDict(extra="forbid")

    shards: int
    by_state: dict[str, int]
    done: int
    total: int
    tokens: Optional[int] = Field(None, description="tokens extracted so far; null when no shard counts "
                                                    "tokens (a [job] reports samples)")
    total_tokens: Optional[int] = Field(None, description="the run's tokens, once every shard's "
                                                          "total_tokens is known")
    gpus_planned: int = Field(0, description="GPUs in the run's plan (a shard may span several)")
    gpus_expected: int = Field(0, description="gpus_planned less the GPUs whose shard is DONE (nothing "
                                              "left to do), STOPPED (taken out on purpose), QUEUED (waiting "
                                              "for its engine to place it) or UNKNOWN "
                                              "(its host is not measured: out of both sides of the "
                                              "ratio). PENDING, STARTING, LOADING, STALLED, FAILED, "
                                              "BACKOFF and FATAL shards count: a GPU that should work "
                                              "and does not lowers the ratio")
    bytes_written: Optional[int] = Field(None, description="null when no shard measures bytes (a [job])")


class RunRates(BaseModel):
    """The run's rates now, and how they compare with the expected figure. One part of Totals (snapshot.py makes each)."""
    model_config = ConfigDict(extra="forbid")

    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    expected_unit: Optional[Literal["samples", "tokens"]] = None
    expected_per_s: Optional[float] = Field(None, description="per-GPU figure x gpus_expected, in "
                                                              "expected_unit")
    expected_tokens_per_s: Optional[float] = Field(
        None, description="the expected rate in tokens/s: tokens_per_s_per_gpu x gpus_expected, or "
                          "samples_per_s_per_gpu x gpus_expected x the run's tokens per sample (from "
                          "the shards whose total_tokens is known); with neither in fleet.toml, on a "
                          "CPU, the mean of what each worker timed at load x gpus_expected")
    ratio: Optional[float] = Field(None, description="measured / expected, in ratio_unit; null until "
                                                     "a shard is measured")
    ratio_unit: Optional[Literal["samples", "tokens"]] = Field(
        None, description="tokens whenever expected_tokens_per_s is known (samples are length-sorted: "
                          "samples/s swings while tokens/s holds), else samples")
    alert: bool = False
    alert_level: Optional[AlertLevel] = Field(None, description="ok; low: under alert_ratio; "
                                                                "critical: under half of it")


class RunEta(BaseModel):
    """The run's ETA, whether it is rough, and the shards it leaves out. One part of Totals (snapshot.py makes each)."""
    model_config = ConfigDict(extra="forbid")

    eta_rough: bool = Field(False, description="the ETA rests on a pace of under 3 minutes (shown '~')")
    eta_left_out: list[int] = Field(default_factory=list, description="shards the ETA leaves out: FATAL "
                                                                       "and STOPPED ones holding rows will "
                                                                       "not finish them")
    eta_s: Optional[float] = Field(None, description="when the last shard that will finish does: each "
                                                     "at its own rate (one not measured now at the "
                                                     "mean rate of those that are), in eta_unit; 0 "
                                                     "when finished")
    eta_unit: Optional[Literal["samples", "tokens"]] = Field(
        None, description="tokens once every shard not DONE has a total_tokens, else samples")


class RunAverages(BaseModel):
    """Over the run's elapsed time: what a finished run is summed up by. One part of Totals (snapshot.py makes each)."""
    model_config = ConfigDict(extra="forbid")

    avg_samples_per_s: Optional[float] = Field(None, description="samples done / elapsed_s")
    avg_tokens_per_s: Optional[float] = Field(None, description="tokens / elapsed_s")
    avg_tokens_per_s_per_gpu: Optional[float] = Field(None, description="avg_tokens_per_s / gpus_planned")


class RunMoney(BaseModel):
    """What the priced hosts cost: an hour, so far, to the end, per million tokens. One part of Totals (snapshot.py makes each)."""
    model_config = ConfigDict(extra="forbid")

    usd_per_hour: Optional[float] = Field(None, description="sum of the hosts' usd_per_hour (hosts "
                                                            "without one count nothing); null when no "
                                                            "host has one")
    usd_spent: Optional[float] = Field(None, description="usd_per_hour x elapsed_s: from the run's "
                                                         "first launch, not from when a box was rented")
    usd_projected: Optional[float] = Field(None, description="usd_spent + usd_per_hour x eta_s: the "
                                                             "whole run's cost at the current rate")
    usd_per_million_tokens: Optional[float] = Field(None, description="usd_spent / tokens x 1e6")


class Totals(RunMoney, RunAverages, RunEta, RunRates, RunCounts):   # (fields in the reverse order: counts first)
    """The run as a whole: its parts (counts, rates, ETA, averages, money) and the rest."""
    elapsed_s: Optional[float] = Field(None, description="since the run's first launch; once settled, "
                                                         "to the last shard's end (frozen)")
    finished: bool = Field(False, description="every shard DONE, or FATAL with its rows done by others")
    rows_moved: int = Field(0, description="unfinished rows that went from one shard to another of its host")
    rows_relocated: int = Field(0, description="rows that went from a lost host to the others "
                                               "([supervise] host_lost_after)")
    rows_redone: int = Field(0, description="of those, rows the lost host had reported finished: done again, "
                                            "its copies are removed by `fleet verify --repair` once it is back")
    disk_full_eta_s: Optional[float] = None
    replayed: bool = Field(False, description="every reachable host's record has been read")
    settled: bool = Field(False, description="every shard DONE, FATAL or STOPPED")
    shipping: Optional[ShippingStatus] = Field(None, description="the run's output against the "
                                                                 "destination, summed; null without one")
    reference: Optional[ReferenceStatus] = Field(None, description="the shards' reference checks, summed")
    bound: Optional[Bound] = Field(None, description="what sets the run's pace: over each running shard's "
                                                     "last minute while it goes, over every batch once it is "
                                                     "settled; null while too little is known (or for a [job])")


class FleetSnapshot(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    schema_: str = Field(SCHEMA, alias="schema")
    run: str
    time: float = Field(description="unix seconds")
    hosts: list[HostStatus]
    shards: list[ShardStatus]
    totals: Totals
    verifiable: bool = Field(True, description="the shards run the built-in worker, whose output "
                                               "`fleet verify` checks (false for a [job])")
    supervisor: Optional[str] = Field(None, description="the run's supervisor this picture is from: its "
                                                        "pid, machine, user, start and log; null when read "
                                                        "from the hosts directly (none runs)")

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(by_alias=True, indent=indent)

    def host(self, name: str) -> HostStatus | None:
        return next((h for h in self.hosts if h.name == name), None)


def json_schema() -> dict:
    return FleetSnapshot.model_json_schema(by_alias=True)


# --- inputs (what the supervisor holds) ---------------------------------------------------------
