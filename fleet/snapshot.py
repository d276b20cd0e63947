"""The one picture of a run: what `status --json` prints, what `status` and `up --headless` render
and what the TUI draws. Pydantic models (the JSON schema is generated from them:
`fleet status --json-schema`) built by one pure function from the judge's verdicts.

Every figure is computed here once; the views only format it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


from worker import protocol

from .bound import Wait, verdict
from .figures import pace, pace_eta, progress_age
from .hosts import Host
from .judge import Rates, Verdict, rates
from .record import ShardRecord
from .schema import (AlertLevel, Bound, FleetSnapshot, Gpu, GpuTotals, HostStatus, ReferenceStatus, RunAverages,
                     RunCounts, RunEta, RunMoney, RunRates, ShardStatus, ShippingStatus, TaskStatus, Totals)
from .state import FAULTY, MEASURED, SETTLED, State
from .units import bytes_text


LIVE_PROGRESS = frozenset({State.STARTING, State.LOADING, State.RUNNING, State.LATE, State.STALLED})

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


def reference_of(r: ShardRecord) -> ReferenceStatus | None:
    ev = r.checked
    return None if ev is None else ReferenceStatus(rows=ev.rows, layer_ids=ev.layer_ids, worst_cosine=ev.worst_cosine,
                                                   worst_rel_err=ev.worst_rel_err, masks=ev.masks,
                                                   failed=ev.failed)


def reference_sum(parts: list[ReferenceStatus | None]) -> ReferenceStatus | None:
    """Several shards' checks as one (the run's): rows summed, the worst of each layer."""
    seen = [p for p in parts if p is not None]
    if not seen:
        return None
    out = ReferenceStatus(rows=sum(p.rows for p in seen), masks=sum(p.masks for p in seen), layer_ids=seen[0].layer_ids,
                          failed=next((p.failed for p in seen if p.failed), None))
    for p in seen:
        if p.worst_cosine and p.layer_ids == out.layer_ids:
            out.worst_cosine = [min(a, b) for a, b in zip(out.worst_cosine, p.worst_cosine)] if out.worst_cosine \
                else list(p.worst_cosine)
            out.worst_rel_err = [max(a, b) for a, b in zip(out.worst_rel_err, p.worst_rel_err)] \
                if out.worst_rel_err else list(p.worst_rel_err)
    return out


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
    seen = [p for p in parts if p is not None]
    if not seen:
        return None
    rates = [p.rate_bps for p in seen if p.rate_bps is not None]
    return ShippingStatus(destination=seen[0].destination,
                          shipped_files=sum(p.shipped_files for p in seen),
                          shipped_bytes=sum(p.shipped_bytes for p in seen),
                          pending_files=sum(p.pending_files for p in seen),
                          pending_bytes=sum(p.pending_bytes for p in seen),
                          rate_bps=sum(rates) if rates else None, waiting=any(p.waiting for p in seen),
                          error=next((p.error for p in seen if p.error), None),
                          finished=all(p.finished for p in seen))


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
    node: str | None = None                # an engine's task: the node its newest launch runs/ran on
    task: TaskStatus | None = None
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
    ends: list[float] = []
    pools: dict[str, list[tuple[ShardRecord, Rates]]] = {}
    for row, v in zip(rows, views):
        if row.state in (State.DONE, State.FATAL, State.STOPPED) or not row.holds_rows:
            continue                       # (a lost host's shard whose rows went to others: theirs now)
        if v.record.lease is not None:
            pools.setdefault(v.host, []).append((v.record, rate_of.get(id(v), mean)))
            continue
        end = row.eta_s if row.eta_s is not None else shard_eta(v.record, row.state, mean)
        if end is None:
            return None
        ends.append(end)
    for p in pools.values():
        end = pool_end(p)
        if end is None:
            return None
        ends.append(end)
    return max(ends, default=None)


def pool_end(shards: list[tuple[ShardRecord, Rates]]) -> float | None:
    """Seconds until a pool's live shards have done its work left, at their summed rate: in
    tokens when every one has sized its rows, else in rows. Summed before it is clamped: just
    after a steal, until both have sized their rows again, the thief's total still lacks the
    rows that the holder's still counts, and the two cancel."""
    if all(r.total_tokens is not None for r, _ in shards):
        left = sum(r.total_tokens - r.tokens for r, _ in shards if r.total_tokens is not None)
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
        id=v.id, host=v.node or v.host, gpu=v.gpu, gpus=list(v.gpus or (v.gpu,)), task=v.task, state=state,
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


def run_finished(rows: list[ShardStatus], moving: bool = False) -> bool:
    """The run's work is all done: every shard DONE, or FATAL, STOPPED or UNKNOWN holding no rows
    (its host's other shards, or the other hosts, took them over and finished them), and no rows
    on their way to another host (`moving`: asked, not yet in its record, where its shards may
    still all read DONE)."""
    return bool(rows) and not moving and all(r.state == State.DONE or (r.state in NO_ROWS_NEEDED and not r.holds_rows)
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
    timed = [v.record.cpu_tokens_per_s for v in views if v.record.cpu_tokens_per_s]
    if not per_gpu and timed:             # no figure given: on a CPU, what its workers timed at load
        per_gpu, unit = sum(timed) / len(timed), "tokens"
    rate = per_gpu * gpus_expected if per_gpu and gpus_expected else None
    sized = [(v.record.total_tokens, v.record.total) for v in views
             if v.record.total_tokens is not None and v.record.total]
    per_sample = (sum(t for t, _ in sized) / sum(n for _, n in sized)) if sized else None
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
    total = run_rows([v.record for v in views])
    if open_ and all(r.total_tokens is not None for r in open_):
        unit, remaining = "tokens", sum(max(r.total_tokens - r.tokens, 0) for r in open_ if r.total_tokens is not None)
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


def bounds(views: list[ShardView], settled: bool) -> tuple[dict[str, Bound | None], Bound | None]:
    """Each host's bound and the run's (fleet/bound.py): over the last minute of each running shard
    while the run goes, over every batch of every launch once it is settled."""
    waits: dict[str, list[Wait]] = {}
    for v in views:
        a = v.record.attempt
        if settled:
            waits.setdefault(v.host, []).append(v.record.whole_wait)
        elif a is not None and not a.ended:
            waits.setdefault(v.host, []).append(a.recent_wait)
    return {h: verdict(ws) for h, ws in waits.items()}, verdict(w for ws in waits.values() for w in ws)


def host_rows(hosts: dict[str, Host], views: list[ShardView], measured: list, hours: float | None,
              now: float, rows: Sequence[ShardStatus],
              bound_of: dict[str, Bound | None]) -> tuple[list[HostStatus], float | None]:
    """Each host as status shows it, and the soonest time a host's disk fills at its current rate."""
    host_tps: dict[str, float] = {}
    for v, x in measured:
        host_tps[v.host] = host_tps.get(v.host, 0.0) + x.tokens_per_s
    records: dict[str, list[ShardRecord]] = {}
    shipping: dict[str, list[ShippingStatus | None]] = {}
    for v, row in itertools.zip_longest(views, rows):        # (one pass: 64 hosts x 512 shards was two)
        records.setdefault(v.host, []).append(v.record)
        shipping.setdefault(v.host, []).append(row.shipping if row is not None else None)
    disk_eta, out = None, []
    for h in hosts.values():
        free = h.disk.free if h.disk else None
        fills = disk_full_eta(records.get(h.name, []), host_tps.get(h.name, 0.0),
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
            shipping=shipping_sum(shipping.get(h.name, [])),
            catching_up=bool(h.reachable and h.catching_up),
            behind_s=_finite(h.behind_s, 0) if h.reachable and h.catching_up else None,
            bound=bound_of.get(h.name)))
    return out, disk_eta


def money(hosts: dict[str, Host], hours: float | None, settled: bool,
          eta: float | None) -> tuple[float | None, float | None, float | None]:
    """What the priced hosts cost an hour, over the run's elapsed time, and at this rate to the end."""
    priced = [h.usd_per_hour for h in hosts.values() if h.usd_per_hour is not None]
    rate = sum(priced) if priced else None
    spent: float | None = None
    projected: float | None = None
    if rate is not None and hours is not None:
        spent = rate * hours
        projected = spent if settled else (spent + rate * eta / 3600 if eta is not None else None)
    return rate, spent, projected


def counts(views: list[ShardView], rows: list[ShardStatus]) -> RunCounts:
    """Shards by state, samples and tokens done, bytes, and the GPUs planned and expected to work."""
    by_state: dict[str, int] = {}
    for row in rows:
        by_state[row.state.value] = by_state.get(row.state.value, 0) + 1
    records = [v.record for v in views]
    sized = bool(records) and all(r.total_tokens is not None for r in records)
    tokens = [r.tokens for r in records if counts_tokens(r)]
    measured = [r.bytes for r in records if counts_tokens(r) or r.bytes]
    total = run_rows(records)
    return RunCounts(shards=len(rows), by_state=by_state,
                total=total, done=min(sum(r.done + r.skipped for r in records), total or math.inf),
                tokens=sum(tokens) if tokens else None,
                total_tokens=sum(r.total_tokens for r in records) if sized else None,
                bytes_written=sum(measured) if measured else None, gpus_planned=sum(gpus_of(v) for v in views),
                gpus_expected=sum(gpus_of(v) for v, row in zip(views, rows) if row.state not in NOT_EXPECTED))


def run_rows(records: list[ShardRecord]) -> int:
    """The run's rows, each once wherever it moved: the plan's ranges when every shard has its own
    (a shard that took rows from another counts them in its total, and so did the other until it
    was told), else the shards' totals."""
    planned = [r.planned for r in records if r.planned is not None]
    if records and len(planned) == len(records):
        return sum(stop - start for start, stop in planned)
    return sum(r.total for r in records)


def throughput(expected, views: list[ShardView], measured: list, gpus_expected: int) -> RunRates:
    """The run's rates now, and how they compare with the expected figure."""
    sps = sum(x.samples_per_s for _, x in measured)
    tps = sum(x.tokens_per_s for _, x in measured)
    vs = against_expected(expected, views, gpus_expected, sps, tps, bool(measured))
    return RunRates(samples_per_s=_finite(sps) if measured else None,
                    tokens_per_s=_finite(tps, 1) if any(counts_tokens(v.record) for v, _ in measured) else None,
                    expected_unit=vs.unit, expected_per_s=_finite(vs.rate), expected_tokens_per_s=_finite(vs.tokens, 1),
                    ratio=_finite(vs.ratio, 3), ratio_unit=vs.ratio_unit,
                    alert=vs.level in ("low", "critical"), alert_level=vs.level)


def eta_fields(rows: list[ShardStatus], eta: float | None, unit: str | None, settled: bool) -> RunEta:
    """The run's ETA, whether it is rough, and the shards it leaves out."""
    return RunEta(eta_s=_finite(eta, 0), eta_unit=unit,
                  eta_rough=eta is not None and not settled and any(r.eta_rough for r in rows if r.state not in SETTLED),
                  eta_left_out=[r.id for r in rows if r.state in (State.FATAL, State.STOPPED) and r.holds_rows])


def averages(done: int, tokens: int | None, gpus: int, elapsed: float | None) -> RunAverages:
    """Over the run's elapsed time: what a finished run is summed up by (tokens: null for a run
    that counts none)."""
    if not elapsed:
        return RunAverages()
    return RunAverages(avg_samples_per_s=_finite(done / elapsed),
                       avg_tokens_per_s=_finite(tokens / elapsed, 1) if tokens is not None else None,
                       avg_tokens_per_s_per_gpu=_finite(tokens / elapsed / gpus, 1) if gpus and tokens is not None
                       else None)


def costs(hosts: dict[str, Host], hours: float | None, settled: bool, eta: float | None,
          tokens: int | None) -> RunMoney:
    rate, spent, projected = money(hosts, hours, settled, eta)
    return RunMoney(usd_per_hour=_finite(rate), usd_spent=_finite(spent), usd_projected=_finite(projected),
                    usd_per_million_tokens=_finite(spent / tokens * 1e6, 3) if spent is not None and tokens else None)


def build_snapshot(run: str, views: list[ShardView], hosts: dict[str, Host], now: float,
                   expected, relocated: tuple[int, int] = (0, 0), verifiable: bool = True,
                   moving: bool = False) -> FleetSnapshot:
    """`views`: every shard of the run's plan; `expected` the config's ExpectedSpec; `now` the
    supervisor's clock; `relocated`: rows moved from lost hosts, and of them redone; `verifiable`:
    the built-in worker's run (not a [job]); `moving`: rows on their way to another host. Each
    figure is one of the small functions above."""
    rows, measured = [], []
    for v in views:
        row, rate = shard_row(v, hosts[v.host], now)
        rows.append(row)
        if rate is not None:
            measured.append((v, rate))
    states = [row.state for row in rows]
    settled = bool(states) and all(s in SETTLED for s in states)
    finished = run_finished(rows, moving)
    eta_unit, eta = run_eta(views, rows, measured, finished)
    elapsed = elapsed_s(views, hosts, settled, now)
    hours = elapsed / 3600 if elapsed is not None else None
    bound_of, run_bound = bounds(views, settled)
    hosts_out, disk_eta = host_rows(hosts, views, measured, hours, now, rows, bound_of)
    n = counts(views, rows)
    parts = (n, throughput(expected, views, measured, n.gpus_expected),
             eta_fields(rows, eta, eta_unit if views else None, settled),
             averages(n.done, n.tokens, n.gpus_planned, elapsed), costs(hosts, hours, settled, eta, n.tokens))
    return FleetSnapshot(
        run=run, time=round(now, 3), hosts=hosts_out, shards=rows, verifiable=verifiable,
        totals=Totals(**{k: getattr(part, k) for part in parts for k in type(part).model_fields},
                      elapsed_s=_finite(elapsed, 1), finished=finished, disk_full_eta_s=_finite(disk_eta, 0),
                      rows_moved=sum(r.rows_moved_in for r in rows),
                      rows_relocated=relocated[0], rows_redone=relocated[1],
                      replayed=all_replayed(hosts.values()), settled=settled,
                      shipping=shipping_sum([row.shipping for row in rows]),
                      reference=reference_sum([row.reference for row in rows]), bound=run_bound))


def status_exit_code(snap: FleetSnapshot) -> int:
    """0 healthy, done or stopped, or finished (a FATAL shard whose rows the others did is no
    fault of the run's, as `fleet up --headless` says too); 1 a shard STALLED/FAILED/BACKOFF/FATAL;
    3 a host unreachable."""
    if any(h.reachable is False for h in snap.hosts):
        return 3
    if not snap.totals.finished and any(s.faulty for s in snap.shards):
        return 1
    return 0
