"""The one picture of a run: what `status --json` prints, what `status` and `up --headless` render
and what the TUI draws. Pydantic models (the JSON schema is generated from them:
`fleet status --json-schema`) built by one pure function from the judge's verdicts.

Every figure is computed here once; the views only format it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from worker import protocol

from .figures import pace, pace_eta, progress_age
from .judge import Rates, Verdict, rates
from .record import ShardRecord
from .state import FAULTY, MEASURED, SETTLED, State
from .units import bytes_text

if TYPE_CHECKING:
    from .store import Host

LIVE_PROGRESS = frozenset({State.STARTING, State.LOADING, State.RUNNING, State.STALLED})

SCHEMA = "fleet.status/2"

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


def gpu_totals(gpus: list[Gpu]) -> GpuTotals | None:
    """None when the host reports no GPU that is not lost."""
    seen = [g for g in gpus if not g.lost]
    if not seen:
        return None
    utils = [g.util for g in seen if g.util is not None]
    temps = [g.temp for g in seen if g.temp is not None]
    return GpuTotals(count=len(gpus), lost=len(gpus) - len(seen), mem_used=sum(g.mem_used or 0 for g in seen),
                     mem_total=sum(g.mem_total or 0 for g in seen), util=sum(utils) / len(utils) if utils else None,
                     temp_max=max(temps) if temps else None, power_w=sum(g.power_w or 0 for g in seen))


class ReferenceStatus(BaseModel):
    """Rows re-computed alone through the model's plain forward and compared with what was written
    (worker/reference.py; [run] reference_checks)."""
    rows: int = Field(0, description="rows checked")
    layer_ids: list[int] = Field(default_factory=list, description="the saved layers, as hs indices")
    worst_cosine: list[float] = Field(default_factory=list, description="per layer, the lowest cosine")
    worst_rel_err: list[float] = Field(default_factory=list, description="per layer, the largest relative error")
    failed: Optional[str] = Field(None, description="the check that failed (the shard stopped for it)")

    @property
    def text(self) -> str:
        """'checked 24 rows ✓ (worst cosine 0.9996, layer 32)', or what failed."""
        if self.failed:
            return f"check failed: {self.failed}"
        if not self.worst_cosine:
            return f"checked {self.rows} rows"
        k = min(range(len(self.worst_cosine)), key=lambda j: self.worst_cosine[j])
        layer = self.layer_ids[k] if k < len(self.layer_ids) else k
        return f"checked {self.rows} rows ✓ (worst cosine {self.worst_cosine[k]:.4f}, layer {layer})"


def reference_of(r: ShardRecord) -> ReferenceStatus | None:
    ev = r.checked
    return None if ev is None else ReferenceStatus(rows=ev.rows, layer_ids=ev.layer_ids, worst_cosine=ev.worst_cosine,
                                                   worst_rel_err=ev.worst_rel_err, failed=ev.failed)


def reference_sum(parts: list[ReferenceStatus | None]) -> ReferenceStatus | None:
    """Several shards' checks as one (the run's): rows summed, the worst of each layer."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = ReferenceStatus(rows=sum(p.rows for p in parts), layer_ids=parts[0].layer_ids,
                          failed=next((p.failed for p in parts if p.failed), None))
    for p in parts:
        if p.worst_cosine and p.layer_ids == out.layer_ids:
            out.worst_cosine = [min(a, b) for a, b in zip(out.worst_cosine, p.worst_cosine)] if out.worst_cosine \
                else list(p.worst_cosine)
            out.worst_rel_err = [max(a, b) for a, b in zip(out.worst_rel_err, p.worst_rel_err)] \
                if out.worst_rel_err else list(p.worst_rel_err)
    return out


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


SHIP_RATE_FRESH_S = 30.0          # a transfer older than this no longer counts in the upload rate


def shipping_of(r: ShardRecord, host_now: float) -> ShippingStatus | None:
    """One shard's shipping, from its newest Shipping event."""
    ev = r.shipping
    if ev is None:
        return None
    fresh = ev.rate_bps is not None and host_now - ev.t < SHIP_RATE_FRESH_S and not ev.finished
    return ShippingStatus(destination=ev.destination, shipped_files=ev.shipped_files,
                          shipped_bytes=ev.shipped_bytes, pending_files=ev.pending_files,
                          pending_bytes=ev.local_bytes, rate_bps=_finite(ev.rate_bps, 0) if fresh else None,
                          waiting=bool(ev.waiting) and not ev.finished, error=ev.error, finished=ev.finished)


def shipping_sum(parts: list[ShippingStatus | None]) -> ShippingStatus | None:
    """Several shards' shipping as one (a host's, the run's)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    rates = [p.rate_bps for p in parts if p.rate_bps is not None]
    return ShippingStatus(destination=parts[0].destination,
                          shipped_files=sum(p.shipped_files for p in parts),
                          shipped_bytes=sum(p.shipped_bytes for p in parts),
                          pending_files=sum(p.pending_files for p in parts),
                          pending_bytes=sum(p.pending_bytes for p in parts),
                          rate_bps=sum(rates) if rates else None, waiting=any(p.waiting for p in parts),
                          error=next((p.error for p in parts if p.error), None),
                          finished=all(p.finished for p in parts))


class HostStatus(BaseModel):
    name: str
    address: str
    role: Optional[Literal["login", "node"]] = Field(None, description="with [slurm]: the login node "
                                                     "fleet submits from (named \"slurm\"), or a compute "
                                                     "node its tasks run on (GPUs as they report them); "
                                                     "null for [[hosts]]")
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


class SlurmTaskStatus(BaseModel):
    job: Optional[str] = Field(None, description="the array task, \"<array job id>_<index>\"")
    state: Optional[str] = Field(None, description="Slurm's state now (PENDING, RUNNING, COMPLETING), "
                                                   "or its final one as recorded (CANCELLED, TIMEOUT, ...)")
    reason: Optional[str] = Field(None, description="Slurm's reason (Priority, Resources, ...)")
    node: Optional[str] = None


class ShardStatus(BaseModel):
    id: int
    host: str = Field(description="where it runs or ran; with [slurm] its node once started, "
                                  "\"slurm\" before")
    gpu: int
    gpus: list[int] = Field(default_factory=list, description="every GPU of the shard (gpus_per_shard)")
    slurm: Optional[SlurmTaskStatus] = Field(None, description="with [slurm]: its newest launch's task")
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
    progress_late: bool = Field(False, description="progress_age_s over 3 usual intervals: a stall in "
                                                   "the making, long before stall_timeout")
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


class Totals(BaseModel):
    shards: int
    by_state: dict[str, int]
    done: int
    total: int
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tokens: Optional[int] = Field(None, description="tokens extracted so far; null when no shard counts "
                                                    "tokens (a [job] reports samples)")
    total_tokens: Optional[int] = Field(None, description="the run's tokens, once every shard's "
                                                          "total_tokens is known")
    gpus_planned: int = Field(0, description="GPUs in the run's plan (a shard may span several)")
    gpus_expected: int = Field(0, description="gpus_planned less the GPUs whose shard is DONE (nothing "
                                              "left to do), STOPPED (taken out on purpose), QUEUED (waiting "
                                              "for Slurm to place it) or UNKNOWN "
                                              "(its host is not measured: out of both sides of the "
                                              "ratio). PENDING, STARTING, LOADING, STALLED, FAILED, "
                                              "BACKOFF and FATAL shards count: a GPU that should work "
                                              "and does not lowers the ratio")
    expected_unit: Optional[Literal["samples", "tokens"]] = None
    expected_per_s: Optional[float] = Field(None, description="per-GPU figure x gpus_expected, in "
                                                              "expected_unit")
    expected_tokens_per_s: Optional[float] = Field(
        None, description="the expected rate in tokens/s: tokens_per_s_per_gpu x gpus_expected, or "
                          "samples_per_s_per_gpu x gpus_expected x the run's tokens per sample (from "
                          "the shards whose total_tokens is known)")
    ratio: Optional[float] = Field(None, description="measured / expected, in ratio_unit; null until "
                                                     "a shard is measured")
    ratio_unit: Optional[Literal["samples", "tokens"]] = Field(
        None, description="tokens whenever expected_tokens_per_s is known (samples are length-sorted: "
                          "samples/s swings while tokens/s holds), else samples")
    alert: bool = False
    alert_level: Optional[AlertLevel] = Field(None, description="ok; low: under alert_ratio; "
                                                                "critical: under half of it")
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
    elapsed_s: Optional[float] = Field(None, description="since the run's first launch; once settled, "
                                                         "to the last shard's end (frozen)")
    finished: bool = Field(False, description="every shard DONE, or FATAL with its rows done by others")
    rows_moved: int = Field(0, description="unfinished rows that went from one shard to another of its host")
    rows_relocated: int = Field(0, description="rows that went from a lost host to the others "
                                               "([supervise] host_lost_after)")
    rows_redone: int = Field(0, description="of those, rows the lost host had reported finished: done again, "
                                            "its copies are removed by `fleet verify --repair` once it is back")
    avg_samples_per_s: Optional[float] = Field(None, description="samples done / elapsed_s")
    avg_tokens_per_s: Optional[float] = Field(None, description="tokens / elapsed_s")
    avg_tokens_per_s_per_gpu: Optional[float] = Field(None, description="avg_tokens_per_s / gpus_planned")
    bytes_written: Optional[int] = Field(None, description="null when no shard measures bytes (a [job])")
    disk_full_eta_s: Optional[float] = None
    usd_per_hour: Optional[float] = Field(None, description="sum of the hosts' usd_per_hour (hosts "
                                                            "without one count nothing); null when no "
                                                            "host has one")
    usd_spent: Optional[float] = Field(None, description="usd_per_hour x elapsed_s: from the run's "
                                                         "first launch, not from when a box was rented")
    usd_projected: Optional[float] = Field(None, description="usd_spent + usd_per_hour x eta_s: the "
                                                             "whole run's cost at the current rate")
    usd_per_million_tokens: Optional[float] = Field(None, description="usd_spent / tokens x 1e6")
    replayed: bool = Field(False, description="every reachable host's record has been read")
    settled: bool = Field(False, description="every shard DONE, FATAL or STOPPED")
    shipping: Optional[ShippingStatus] = Field(None, description="the run's output against the "
                                                                 "destination, summed; null without one")
    reference: Optional[ReferenceStatus] = Field(None, description="the shards' reference checks, summed")


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

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(by_alias=True, indent=indent)

    def host(self, name: str) -> HostStatus | None:
        return next((h for h in self.hosts if h.name == name), None)


def json_schema() -> dict:
    return FleetSnapshot.model_json_schema(by_alias=True)


# --- inputs (what the supervisor holds) ---------------------------------------------------------

@dataclass
class ShardView:
    """One shard as the snapshot needs it: where it runs, its record, its liveness, the verdict."""
    id: int
    host: str
    gpu: int
    record: ShardRecord
    verdict: Verdict
    alive: bool | None = None
    pid: int | None = None
    max_restarts: int = 0
    node: str | None = None                # with [slurm]: the node its newest launch runs/ran on
    slurm: SlurmTaskStatus | None = None
    gpus: tuple[int, ...] = ()
    idle_s: float | None = None            # monotonic seconds since its last progress (the agent's)
    moved_to: str | None = None            # its host was lost and its rows went to this host
    damage: protocol.RecordDamage | None = None   # what of its record its host's agent could not read


# --- the one computation ------------------------------------------------------------------------

def _finite(x: float | None, digits: int = 2) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


def alert_level(ratio: float | None, alert_ratio: float) -> AlertLevel | None:
    if ratio is None:
        return None
    if ratio >= alert_ratio:
        return "ok"
    return "low" if ratio >= alert_ratio / 2 else "critical"


def all_replayed(hosts) -> bool:
    """Every host's record has been read, or the host is known unreachable: the picture is whole."""
    return all(h.replayed or h.reachable is False for h in hosts)


def eta(remaining: float, rate: float | None) -> float | None:
    """Seconds to do `remaining` at `rate`; None when not measured or not moving."""
    return remaining / rate if rate is not None and rate > 0 else None


def counts_tokens(r: ShardRecord) -> bool:
    """The shard reports tokens (the built-in worker does; a [job] reports samples): a rate in tokens
    of one that does not is not measured (null), never 0."""
    return r.total_tokens is not None or r.tokens > 0


def shard_eta(r: ShardRecord, state: State, rate: Rates | None) -> float | None:
    """One shard's remaining work at its own rate: tokens when its total is known, else samples."""
    if state == State.DONE:
        return 0.0
    if rate is None:
        return None
    if r.total_tokens is not None:
        return eta(max(r.total_tokens - r.tokens, 0), rate.tokens_per_s)
    return eta(max(r.total - r.done - r.skipped, 0), rate.samples_per_s)


def shard_progress(r: ShardRecord, state: State) -> float | None:
    """Done, in the unit of the shard's ETA: samples are length-sorted, so a shard a quarter
    through its samples can be half through its tokens. Never above 1: a [job] that counts past
    its total (more files than rows, a wrong total) is at 100%, not 140%."""
    if state == State.DONE:
        return 1.0
    if r.total_tokens:
        return _finite(min(r.tokens / r.total_tokens, 1.0), 4)
    return _finite(min((r.done + r.skipped) / r.total, 1.0), 4) if r.total else None


def last_shard_eta(rows: list[ShardStatus], views: list[ShardView],
                   measured: list[tuple[ShardView, Rates]]) -> float | None:
    """When the run ends: when its last pool does. A shard with fixed rows ends at its own ETA;
    the shards of one host that share their rows (their records hold a lease: worker/leases.py)
    end together, when the pool's work left is done at their summed rate (pool_end). A shard not
    measured now (BACKOFF, LOADING, queued, host down) is counted at the mean rate of the shards
    that are; FATAL and STOPPED shards will not finish and are left out. None when nothing is
    measured."""
    if not measured:
        return None
    n = len(measured)
    mean = Rates(samples_per_s=sum(x.samples_per_s for _, x in measured) / n,
                 tokens_per_s=sum(x.tokens_per_s for _, x in measured) / n,
                 bytes_per_s=sum(x.bytes_per_s for _, x in measured) / n)
    rate_of = {id(v): x for v, x in measured}
    ends, pools = [], {}
    for row, v in zip(rows, views):
        if row.state in (State.DONE, State.FATAL, State.STOPPED):
            continue
        if v.record.lease is not None:
            pools.setdefault(v.host, []).append((v.record, rate_of.get(id(v), mean)))
            continue
        end = row.eta_s if row.eta_s is not None else shard_eta(v.record, row.state, mean)
        if end is None:
            return None
        ends.append(end)
    ends += [pool_end(p) for p in pools.values()]
    return None if None in ends else max(ends, default=None)


def pool_end(shards: list[tuple[ShardRecord, Rates]]) -> float | None:
    """Seconds until a pool's live shards have done its work left, at their summed rate: in
    tokens when every one has sized its rows, else in rows. Summed before it is clamped: just
    after a steal, until both have sized their rows again, the thief's total still lacks the
    rows that the holder's still counts, and the two cancel."""
    if all(r.total_tokens is not None for r, _ in shards):
        left = sum(r.total_tokens - r.tokens for r, _ in shards)
        speed = sum(x.tokens_per_s for _, x in shards)
    else:
        left = sum(r.total - r.done - r.skipped for r, _ in shards)
        speed = sum(x.samples_per_s for _, x in shards)
    return eta(max(left, 0), speed)


def disk_full_eta(records: list[ShardRecord], tokens_per_s: float, free: int) -> float | None:
    """Seconds until a host's disk is full at its current tokens/s and the bytes per token its
    shards actually wrote (fp8 or bf16, layers, file overhead: as measured); None when nothing is
    measured yet or when the rows left, at the tokens per sample seen so far, fit in `free`."""
    done, tokens = sum(r.done for r in records), sum(r.tokens for r in records)
    if not done or not tokens or tokens_per_s <= 0:
        return None
    per_token = sum(r.bytes for r in records) / tokens
    left = sum(max(r.total - r.done - r.skipped, 0) for r in records) * tokens / done
    return None if left * per_token <= free else free / (tokens_per_s * per_token)


NOT_EXPECTED = (State.DONE, State.STOPPED, State.UNKNOWN, State.QUEUED)   # GPUs not expected to produce


def shard_row(v: ShardView, host: Host, now: float) -> tuple[ShardStatus, Rates | None]:
    """One shard's row and its rates (None: not measured), from its record and verdict."""
    hn = host.host_now(now)
    state = v.verdict.state                                  # UNKNOWN where its host cannot be read: the judge's
    r, a = v.record, v.record.attempt
    rate = rates(r, state, hn) if host.reachable else None
    row = ShardStatus(
        id=v.id, host=v.node or v.host, gpu=v.gpu, gpus=list(v.gpus or (v.gpu,)), slurm=v.slurm, state=state,
        reason=v.verdict.reason,
        faulty=state in FAULTY, done=r.done, skipped=r.skipped, total=r.total,
        progress=shard_progress(r, state),
        tokens=r.tokens if counts_tokens(r) else None, total_tokens=r.total_tokens,
        bytes=r.bytes if counts_tokens(r) or r.bytes else None,
        samples_per_s=_finite(rate.samples_per_s) if rate else None,
        tokens_per_s=_finite(rate.tokens_per_s, 1) if rate and counts_tokens(r) else None,
        **shard_eta_fields(r, state, rate, hn),
        **lateness(r, state, hn, v.idle_s) if host.reachable else {},
        **life(v, host, state, hn),
        restarts=max(r.launches - 1, 0), auto_attempts=v.verdict.attempts,
        max_restarts=v.max_restarts, failures=r.failures, last_failure=r.last_failure,
        writer_wait_s=r.writer_wait_s, gpu_mem_bytes=r.gpu_mem_bytes, warning=r.warning,
        detail=a.detail if a and state == State.LOADING else None, path=r.path,
        shipping=shipping_of(r, hn), **lease_fields(v),
        record_problem=record_problem(v.damage), over_total=bool(r.total) and r.done + r.skipped > r.total,
        reference=reference_of(r))
    return row, rate


def record_problem(damage: protocol.RecordDamage | None) -> str | None:
    """A record's unreadable bytes, as a person reads them."""
    if damage is None:
        return None
    lines = f"{damage.bad_lines} line(s), " if damage.bad_lines > 1 else ""
    return f"events.jsonl: {lines}{bytes_text(damage.bad_bytes)} unreadable after line {damage.after_line:,}"


def lease_fields(v: ShardView) -> dict:
    """What the shard holds: its record's word, unless its host was lost and its rows moved on."""
    r = v.record
    if v.moved_to is not None and r.holds_rows:
        return dict(lease=f"none: its rows went to {v.moved_to} (this host was lost)", rows_moved_in=r.rows_in,
                    rows_moved_out=r.rows_out, holds_rows=False)
    return dict(lease=r.lease, rows_moved_in=r.rows_in, rows_moved_out=r.rows_out, holds_rows=r.holds_rows)


def run_finished(rows: list[ShardStatus]) -> bool:
    """The run's work is all done: every shard DONE, or FATAL, STOPPED or UNKNOWN holding no rows
    (its host's other shards, or the other hosts, took them over and finished them)."""
    return bool(rows) and all(r.state == State.DONE or (r.state in NO_ROWS_NEEDED and not r.holds_rows)
                              for r in rows)


NO_ROWS_NEEDED = (State.FATAL, State.STOPPED, State.UNKNOWN)   # states that end nothing while holding none


def shard_eta_fields(r: ShardRecord, state: State, rate: Rates | None, host_now: float) -> dict:
    """The shard's ETA at its pace over minutes (its rate now until that is measured), and
    whether that pace is still short (rough)."""
    shard_pace = pace(r, host_now) if state in MEASURED else None
    eta_s = 0.0 if state == State.DONE else pace_eta(r, shard_pace)
    if eta_s is None:
        eta_s = shard_eta(r, state, rate)
    rough = state != State.DONE and eta_s is not None and not (shard_pace is not None and shard_pace.settled)
    return dict(eta_s=_finite(eta_s, 0), eta_rough=rough)


def lateness(r: ShardRecord, state: State, host_now: float, idle_s: float | None) -> dict:
    """How long a live shard has gone without progress, against its own usual interval."""
    late = progress_age(r, host_now, idle_s) if state in LIVE_PROGRESS else None
    if late is None:
        return {}
    return dict(progress_age_s=_finite(late.age_s, 1), progress_late=late.late,
                progress_interval_s=_finite(late.usual_s, 1) if late.usual_s is not None else None)


def life(v: ShardView, host: Host, state: State, host_now: float) -> dict:
    """Its process (alive, pid, exit code), its last event, and when a pending restart is due."""
    r, a, due = v.record, v.record.attempt, v.verdict.due_t
    return dict(alive=v.alive if host.reachable else None,
                pid=(v.pid or (a.pid if a and not a.ended else None)) if v.alive else None,
                exit_code=a.end.code if a and a.end else None, last_event=r.last_event,
                last_event_age_s=_finite(host_now - r.last_event_t, 1) if r.last_event_t else None,
                backoff_s=_finite(max(due - host_now, 0.0), 1) if due is not None and state != State.UNKNOWN else None)


def gpus_of(v: ShardView) -> int:
    return len(v.gpus) if v.gpus else 1           # a shard over several GPUs counts each of them


@dataclass(frozen=True)
class Against:
    """Throughput against the expected figure (per GPU, times the GPUs that should be working)."""
    unit: str | None
    rate: float | None                 # expected, in `unit`
    tokens: float | None               # expected, in tokens
    ratio: float | None
    ratio_unit: str | None
    level: AlertLevel | None


def against_expected(expected, views: list[ShardView], gpus_expected: int, sps: float, tps: float,
                     measured: bool) -> Against:
    per_gpu, unit = (expected.samples_per_s_per_gpu, "samples") if expected.samples_per_s_per_gpu \
        else (expected.tokens_per_s_per_gpu, "tokens")
    rate = per_gpu * gpus_expected if per_gpu and gpus_expected else None
    sized = [v.record for v in views if v.record.total_tokens is not None and v.record.total]
    per_sample = (sum(r.total_tokens for r in sized) / sum(r.total for r in sized)) if sized else None
    tokens = rate if unit == "tokens" else (rate * per_sample if rate and per_sample else None)
    ratio, ratio_unit = None, None
    if tokens:
        ratio, ratio_unit = (tps / tokens if measured else None), "tokens"
    elif rate:
        ratio, ratio_unit = (sps / rate if measured else None), "samples"
    return Against(unit if per_gpu else None, rate, tokens, ratio, ratio_unit,
                   alert_level(_finite(ratio, 3), expected.alert_ratio))


def run_eta(views: list[ShardView], rows: list[ShardStatus], measured: list, finished: bool) -> tuple[str, float | None]:
    """What is left, in tokens when every unfinished shard knows its total, and when the run ends."""
    open_ = [v.record for v, row in zip(views, rows) if row.state != State.DONE]
    total = sum(v.record.total for v in views)
    if open_ and all(r.total_tokens is not None for r in open_):
        unit, remaining = "tokens", sum(max(r.total_tokens - r.tokens, 0) for r in open_)
    else:
        unit = "samples"
        remaining = max(total - sum(v.record.done + v.record.skipped for v in views), 0)
    eta = 0.0 if finished or (total and remaining == 0) else last_shard_eta(rows, views, measured)
    return unit, eta


def elapsed_s(views: list[ShardView], hosts: dict[str, Host], settled: bool, now: float) -> float | None:
    """From the first launch, on the supervisor's clock; once settled, to the last event."""
    starts = [v.record.first_launch_t - hosts[v.host].clock_offset for v in views
              if v.record.first_launch_t is not None]
    if not starts:
        return None
    ends = [v.record.last_event_t - hosts[v.host].clock_offset for v in views if v.record.last_event_t is not None]
    end = max(ends) if settled and ends else now
    return max(end - min(starts), 0.0)


def host_rows(hosts: dict[str, Host], views: list[ShardView], measured: list, hours: float | None,
              now: float, rows: list[ShardStatus] = ()) -> tuple[list[HostStatus], float | None]:
    """Each host as status shows it, and the soonest time a host's disk fills at its current rate."""
    host_tps: dict[str, float] = {}
    for v, x in measured:
        host_tps[v.host] = host_tps.get(v.host, 0.0) + x.tokens_per_s
    disk_eta, out = None, []
    for h in hosts.values():
        free = h.disk.free if h.disk else None
        fills = disk_full_eta([v.record for v in views if v.host == h.name], host_tps.get(h.name, 0.0),
                              free) if free is not None and h.reachable else None
        if fills is not None:
            disk_eta = min(disk_eta if disk_eta is not None else math.inf, fills)
        out.append(HostStatus(
            name=h.name, address=h.address, role=h.role, reachable=h.reachable, error=h.error,
            unusable=h.unusable and h.reachable is False,
            telemetry=h.telemetry if h.reachable else None,
            gpus=list(h.gpus) if h.reachable else None,
            gpu_totals=gpu_totals([Gpu.model_validate(g) for g in h.gpus]) if h.reachable else None,
            gpu_age_s=_finite(h.host_now(now) - h.gpu_t, 1) if h.gpu_t and h.reachable else None,
            disk=h.disk if h.reachable else None,
            last_seen_age_s=_finite(now - h.last_seen, 1) if h.last_seen else None,
            replayed=h.replayed, usd_per_hour=h.usd_per_hour,
            usd_spent=_finite(h.usd_per_hour * hours) if h.usd_per_hour is not None and hours is not None
            else None,
            shipping=shipping_sum([row.shipping for v, row in zip(views, rows) if v.host == h.name]),
            catching_up=bool(h.reachable and h.catching_up),
            behind_s=_finite(h.behind_s, 0) if h.reachable and h.catching_up else None))
    return out, disk_eta


def money(hosts: dict[str, Host], hours: float | None, settled: bool,
          eta: float | None) -> tuple[float | None, float | None, float | None]:
    """What the priced hosts cost an hour, over the run's elapsed time, and at this rate to the end."""
    priced = [h.usd_per_hour for h in hosts.values() if h.usd_per_hour is not None]
    rate = sum(priced) if priced else None
    spent = rate * hours if rate is not None and hours is not None else None
    projected = None
    if spent is not None:
        projected = spent if settled else (spent + rate * eta / 3600 if eta is not None else None)
    return rate, spent, projected


def counts(views: list[ShardView], rows: list[ShardStatus]) -> dict:
    """Shards by state, samples and tokens done, bytes, and the GPUs planned and expected to work."""
    by_state: dict[str, int] = {}
    for row in rows:
        by_state[row.state.value] = by_state.get(row.state.value, 0) + 1
    records = [v.record for v in views]
    sized = bool(records) and all(r.total_tokens is not None for r in records)
    tokens = [r.tokens for r in records if counts_tokens(r)]
    measured = [r.bytes for r in records if counts_tokens(r) or r.bytes]
    return dict(shards=len(rows), by_state=by_state, done=sum(r.done + r.skipped for r in records),
                total=sum(r.total for r in records), tokens=sum(tokens) if tokens else None,
                total_tokens=sum(r.total_tokens for r in records) if sized else None,
                bytes_written=sum(measured) if measured else None, gpus_planned=sum(gpus_of(v) for v in views),
                gpus_expected=sum(gpus_of(v) for v, row in zip(views, rows) if row.state not in NOT_EXPECTED))


def throughput(expected, views: list[ShardView], measured: list, gpus_expected: int) -> dict:
    """The run's rates now, and how they compare with the expected figure."""
    sps = sum(x.samples_per_s for _, x in measured)
    tps = sum(x.tokens_per_s for _, x in measured)
    vs = against_expected(expected, views, gpus_expected, sps, tps, bool(measured))
    return dict(samples_per_s=_finite(sps) if measured else None,
                tokens_per_s=_finite(tps, 1) if any(counts_tokens(v.record) for v, _ in measured) else None,
                expected_unit=vs.unit, expected_per_s=_finite(vs.rate), expected_tokens_per_s=_finite(vs.tokens, 1),
                ratio=_finite(vs.ratio, 3), ratio_unit=vs.ratio_unit,
                alert=vs.level in ("low", "critical"), alert_level=vs.level)


def eta_fields(rows: list[ShardStatus], eta: float | None, unit: str | None, settled: bool) -> dict:
    """The run's ETA, whether it is rough, and the shards it leaves out."""
    return dict(eta_s=_finite(eta, 0), eta_unit=unit,
                eta_rough=eta is not None and not settled and any(r.eta_rough for r in rows if r.state not in SETTLED),
                eta_left_out=[r.id for r in rows if r.state in (State.FATAL, State.STOPPED) and r.holds_rows])


def averages(done: int, tokens: int | None, gpus: int, elapsed: float | None) -> dict:
    """Over the run's elapsed time: what a finished run is summed up by (tokens: null for a run
    that counts none)."""
    if not elapsed:
        return {}
    return dict(avg_samples_per_s=_finite(done / elapsed),
                avg_tokens_per_s=_finite(tokens / elapsed, 1) if tokens is not None else None,
                avg_tokens_per_s_per_gpu=_finite(tokens / elapsed / gpus, 1) if gpus and tokens is not None else None)


def costs(hosts: dict[str, Host], hours: float | None, settled: bool, eta: float | None, tokens: int | None) -> dict:
    rate, spent, projected = money(hosts, hours, settled, eta)
    return dict(usd_per_hour=_finite(rate), usd_spent=_finite(spent), usd_projected=_finite(projected),
                usd_per_million_tokens=_finite(spent / tokens * 1e6, 3) if spent is not None and tokens else None)


def build_snapshot(run: str, views: list[ShardView], hosts: dict[str, Host], now: float,
                   expected, relocated: tuple[int, int] = (0, 0), verifiable: bool = True) -> FleetSnapshot:
    """`views`: every shard of the run's plan; `expected` the config's ExpectedSpec; `now` the
    supervisor's clock; `relocated`: rows moved from lost hosts, and of them redone; `verifiable`:
    the built-in worker's run (not a [job]). Each figure is one of the small functions above."""
    rows, measured = [], []
    for v in views:
        row, rate = shard_row(v, hosts[v.host], now)
        rows.append(row)
        if rate is not None:
            measured.append((v, rate))
    states = [row.state for row in rows]
    settled = bool(states) and all(s in SETTLED for s in states)
    finished = run_finished(rows)
    eta_unit, eta = run_eta(views, rows, measured, finished)
    elapsed = elapsed_s(views, hosts, settled, now)
    hours = elapsed / 3600 if elapsed is not None else None
    hosts_out, disk_eta = host_rows(hosts, views, measured, hours, now, rows)
    n = counts(views, rows)
    return FleetSnapshot(
        run=run, time=round(now, 3), hosts=hosts_out, shards=rows, verifiable=verifiable,
        totals=Totals(**n, **throughput(expected, views, measured, n["gpus_expected"]),
                      **eta_fields(rows, eta, eta_unit if views else None, settled),
                      **averages(n["done"], n["tokens"], n["gpus_planned"], elapsed),
                      **costs(hosts, hours, settled, eta, n["tokens"]),
                      elapsed_s=_finite(elapsed, 1), finished=finished, disk_full_eta_s=_finite(disk_eta, 0),
                      rows_moved=sum(r.rows_moved_in for r in rows),
                      rows_relocated=relocated[0], rows_redone=relocated[1],
                      replayed=all_replayed(hosts.values()), settled=settled,
                      shipping=shipping_sum([row.shipping for row in rows]),
                      reference=reference_sum([row.reference for row in rows])))


def status_exit_code(snap: FleetSnapshot) -> int:
    """0 healthy, done or stopped, or finished (a FATAL shard whose rows the others did is no
    fault of the run's, as `fleet up --headless` says too); 1 a shard STALLED/FAILED/BACKOFF/FATAL;
    3 a host unreachable."""
    if any(h.reachable is False for h in snap.hosts):
        return 3
    if not snap.totals.finished and any(s.faulty for s in snap.shards):
        return 1
    return 0
