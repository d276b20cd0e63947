"""Plain-text views of a snapshot: `fleet status` tables and `fleet up --headless` lines."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .schema import FleetSnapshot, ShardStatus
from .state import MEASURED, State
from .units import bytes_text, duration, eta, gib, number, usd

if TYPE_CHECKING:
    from .store import Transition


def finished_summary(snap: FleetSnapshot, sep: str = ", ") -> str:
    """A finished run in one line, as status, the quit message and the finished notice all say it:
    '2/2 shards DONE in 1m17s, avg 1,433 tok/s/GPU, 456.7 MB, $0.12'."""
    return sep.join(finished_parts(snap))


def finished_parts(snap: FleetSnapshot) -> list[str]:
    """finished_summary's parts, most telling first (the live view's banner drops from the end
    what does not fit its width)."""
    t = snap.totals
    done = t.by_state.get(State.DONE.value, 0)
    parts = [f"{done}/{t.shards} shards DONE in {duration(t.elapsed_s)}"
             + (f" ({t.rows_moved:,} rows moved between GPUs)" if t.rows_moved else "")]
    if t.reference is not None:
        parts.append(t.reference.text)
    if t.shipping is not None:
        parts.append(f"at {t.shipping.destination}" if t.shipping.finished
                     else shipping_text(t.shipping))
    if t.avg_tokens_per_s_per_gpu:
        parts.append(f"avg {t.avg_tokens_per_s_per_gpu:,.0f} tok/s/GPU")
    if t.bound is not None:
        parts.append(t.bound.text)
    if t.bytes_written is not None:
        parts.append(bytes_text(t.bytes_written))
    if t.usd_spent is not None:
        parts.append(usd(t.usd_spent))
    return parts


def run_eta_text(t) -> str:
    """'ETA ~1h02m (tokens)': the run's ETA as `fleet status` and the live view's top bar say it."""
    return f"ETA {eta(t.eta_s, t.eta_rough)}" + (f" ({t.eta_unit})" if t.eta_unit and t.eta_s is not None else "")


def shipping_text(sh) -> str:
    """'shipped 1.2 GB (340 files) to s3://b/run, 80.0 MB pending, 95.1 MB/s' (or its error)."""
    text = f"shipped {bytes_text(sh.shipped_bytes)} ({sh.shipped_files:,} files) to {sh.destination}"
    if sh.pending_files:
        text += f", {bytes_text(sh.pending_bytes)} pending"
    if sh.rate_bps:
        text += f", {bytes_text(sh.rate_bps)}/s"
    if sh.waiting:
        text += ", writers waiting (keep_local)"
    if sh.error:
        text += f"; failing, retried: {sh.error}"
    return text


def restarts_text(s) -> str:
    """Automatic restarts against the policy's maximum, and every relaunch when manual ones add to
    them: '1/3', '0/3 (2 in all)'. The live view's `rst` column says the same."""
    return f"{s.auto_attempts}/{s.max_restarts}" + (f" ({s.restarts} in all)" if s.restarts != s.auto_attempts
                                                   else "")


def format_status(snap: FleetSnapshot) -> str:
    t = snap.totals
    cost = (f", {usd(t.usd_spent)} spent" + (f" ({usd(t.usd_projected)} projected)"
                                             if t.usd_projected is not None and not t.settled else "")
            if t.usd_spent is not None else "")
    if t.finished:
        lines = [f"run {snap.run}: finished, {finished_summary(snap)}" + VERIFY_NEXT.get(snap.verifiable, "")]
    else:
        lines = [f"run {snap.run}: {t.done}/{t.total} samples, "
                 + (f"{number(t.tokens_per_s, 0)} tokens/s, " if t.tokens is not None else "")
                 + f"{number(t.samples_per_s)} samples/s"
                 + (f" ({t.ratio:.0%} of expected in {t.ratio_unit})" if t.ratio is not None else "")
                 + (f", {run_eta_text(t)}" if not t.settled else ", nothing running")
                 + (f", written {bytes_text(t.bytes_written)}" if t.bytes_written is not None else "") + cost
                 + (f"; {t.bound.text}" if t.bound is not None else "")]
        if t.shipping is not None:
            lines.append(f"output: {shipping_text(t.shipping)}")
    if t.by_state:
        lines.append("states: " + ", ".join(f"{k} {v}" for k, v in t.by_state.items()))
    for h in snap.hosts:
        if h.reachable is False:
            lines.append(f"host {h.name}: {'unusable' if h.unusable else 'unreachable'} ({h.error})")
            continue
        tele = "no GPU telemetry" if not h.gpus else ", ".join(
            f"gpu{g.index} {gib(g.mem_used)}/{gib(g.mem_total)} GiB" for g in h.gpus)
        lines.append(f"host {h.name}: {tele}; disk free {bytes_text(h.disk.free if h.disk else None)}"
                     + (f"; {shipping_text(h.shipping)}" if h.shipping else "")
                     + (f"; {h.bound.text}" if h.bound is not None else ""))
    if not snap.shards:
        lines.append("shards: unknown (no reachable host holds the run's plan or records)")
        return "\n".join(lines)
    wide = max(14, *(len(f"{s.host}:{s.gpu}") + 2 for s in snap.shards))   # an engine's node names run long
    lines.append(f"{'shard':>5}  {'where':<{wide}}{'state':<9}{'progress':>16}{'samples/s':>11}"
                 f"  {'restarts':<15}reason")
    for s in snap.shards:
        prog = f"{s.done + s.skipped}/{s.total}" + ("⚠" if s.over_total else "")
        lines.append(f"{s.id:>5}  {s.host + ':' + str(s.gpu):<{wide}}{s.state.value:<9}{prog:>16}"
                     f"{number(s.samples_per_s) if s.state in MEASURED else '—':>11}  "
                     f"{restarts_text(s):<15}{' · '.join(filter(None, (s.reason, note(s))))}")
    return "\n".join(lines)


def note(s: ShardStatus) -> str:
    """What is worth a look beside its state: its record partly unreadable, progress past its total,
    the worker's warning."""
    if s.record_problem:
        return f"⚠ {s.record_problem}"
    if s.over_total:
        return f"⚠ progress {s.done + s.skipped:,} is more than its total {s.total:,}: it counts more than its own work"
    return f"⚠ {s.warning}" if s.warning else ""


def transition_lines(changes: list[Transition], snap: FleetSnapshot) -> list[str]:
    """One line per published transition (`up --headless`); a host's history is summed up once
    its agent has replayed it (the transitions from no state)."""
    rows = {s.id: s for s in snap.shards}
    stamp = time.strftime("%H:%M:%S")
    out = []
    for c in changes:
        s = rows.get(c.shard)
        if s is None:
            continue
        why = f" ({s.reason})" if s.reason and c.after not in (State.RUNNING, State.DONE) else ""
        out.append(f"{stamp} shard {s.id} {s.host}:{s.gpu} {c.before.value if c.before else '-'} -> "
                   f"{c.after.value} {s.done + s.skipped}/{s.total}{why}")
    return out


HEADLESS_PROGRESS_S = 60.0     # `up --headless` prints where each live shard is this often


def progress_lines(snap: FleetSnapshot) -> list[str]:
    """`up --headless` while it runs: the run in a line, then each live shard's done, rate and ETA,
    so hours of RUNNING are not hours of silence."""
    t = snap.totals
    stamp = time.strftime("%H:%M:%S")
    rate = f"{number(t.tokens_per_s, 0)} tokens/s" if t.tokens_per_s is not None else f"{number(t.samples_per_s)} samples/s"
    out = [f"{stamp} run {snap.run}: {t.done:,}/{t.total:,} samples, {rate}, {run_eta_text(t)}"]
    for s in snap.shards:
        if s.state in MEASURED or s.state == State.LOADING:
            rate = f"{number(s.tokens_per_s, 0)} tok/s" if s.tokens_per_s is not None else \
                f"{number(s.samples_per_s)} samples/s"
            out.append(f"{stamp} shard {s.id} {s.host}:{s.gpu} {s.state.value} {s.done + s.skipped:,}/{s.total:,}, "
                       f"{rate}, ETA {eta(s.eta_s, s.eta_rough)}" + (f" ({s.reason})" if s.reason else ""))
    return out


def lease_line(ev, shard: int, where, state_of=lambda k: None) -> str | None:
    """A move of rows onto `shard` as the log view says it (`where`: shard -> "host:gpu";
    `state_of`: shard -> its state now): 'rows 41,200–45,000 of gpubox3:5 (FATAL) → gpubox1:2';
    None for a shard's planned rows. A lease taken over is its holder's whose process was not
    running: crashed, given up, or not started yet — its state says which."""
    gone = state_of(ev.from_shard) if ev.how == "dead" and ev.from_shard is not None else None
    why = {"dead": gone.value if gone is not None else "not running", "stolen": "slower",
           "reopened": "repaired"}.get(ev.how)
    if ev.how == "adopted":
        source = f"{ev.from_host} (lost)"
    elif why is not None and ev.from_shard is not None:
        source = f"{where(ev.from_shard)} ({why})"
    else:
        return None
    return f"rows {ev.start:,}–{ev.stop:,} of {source} → {where(shard)} ({ev.rows:,} to do)"


VERIFY_NEXT = {True: "; check the output and get the exact training command: fleet verify"}   # not for a [job]

QUIT_MESSAGE = ("fleet: the workers keep running, and the run's supervisor keeps supervising them. "
                "`fleet up` rejoins, `fleet status` shows them, `fleet down` stops them.")


def quit_message(snap: FleetSnapshot | None) -> str:
    """What `fleet up` prints when its live view closes: true to what is left running, and naming
    the shards that need a look (FATAL, STALLED, FAILED) so they are not lost in 'keep running'."""
    if snap is None or not snap.totals.replayed or not snap.totals.settled:
        return QUIT_MESSAGE + needing_a_look(snap)
    t = snap.totals
    if t.finished:
        return f"fleet: run {snap.run} is finished: {finished_summary(snap)}" + VERIFY_NEXT.get(snap.verifiable, "")
    counts = ", ".join(f"{n} {s}" for s, n in t.by_state.items())
    return (f"fleet: nothing of run {snap.run} is running ({counts}). `fleet up` launches every shard "
            f"that is not DONE; `fleet status` shows them." + needing_a_look(snap))


LOOK_AT = (State.FATAL, State.STALLED, State.FAILED)


def needing_a_look(snap: FleetSnapshot | None) -> str:
    """'\n  FATAL: shard 3 (box1:3): gave up after ...' for each shard in LOOK_AT (at most 8)."""
    if snap is None:
        return ""
    bad = [s for s in snap.shards if s.state in LOOK_AT]
    lines = [f"\n  {s.state.value}: shard {s.id} ({s.host}:{s.gpu})" + (f": {s.reason}" if s.reason else "")
             for s in bad[:8]]
    if len(bad) > 8:
        lines.append(f"\n  … and {len(bad) - 8} more (fleet status)")
    return "".join(lines)
