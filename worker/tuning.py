"""Tuning flash-linear-attention's Triton kernels for a hybrid shard, once, at load.

fla's kernels choose among their Triton configs by timing each candidate on the first call with a
new autotune key. In a Gated-DeltaNet forward only two keys hold a size — the gate cumsum's row
count `B` and the l2 norm's token bucket `NB`; every other key holds only head counts, head
widths and chunk sizes, fixed by the model. Left to itself, Triton tunes the size-keyed kernels
again for every new row count, which made a 27B hybrid's load spend a minute on 16 row buckets
and still tune mid-run. So here:

- `install()` (once per process, idempotent): an autotuner that meets a key differing from one it
  has tuned only in sizes (integer entries named in SIZE_NAMES) takes that key's winner without
  timing anything (`similar`); each candidate it does time is timed for 5 + 20 ms, not Triton's
  25 + 100; three kernels time fewer candidates (`FEWER`).
  Every kernel is then tuned once — at the first shape it sees, which the load makes the shard's
  main batch shape — and the results land in Triton's on-disk autotune cache (fla asks for it;
  `TRITON_CACHE_AUTOTUNING` for the rest) under the host's `<root>/cache`, where every later run
  and shard of the host finds them.
- `batch_shapes()`: the (rows, width) shapes the shard's own batches will have, from its rows'
  lengths, the one holding the most tokens first.
- `Tuner`: a thread started before the model's weights are built. It reads the shard's first
  rows, builds one linear-attention block of the model's own class (random weights from a private
  generator, a few hundred MB), runs it once per batch shape of the shard (the main shape first:
  that is where the kernels tune), and reports each step. Meanwhile the load builds the weights
  and compiles the other regions with the blocks set aside (`linear_attention_aside`), and waits
  for the thread only then.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, cast

import torch

from .batching import length_batches, padded_length

if TYPE_CHECKING:
    from .gdn import GatedDeltaNetParts

STATS: Counter[str] = Counter()   # tuned: keys timed (or read from disk); reused: took a similar key's winner


# Autotune key names that hold a size (a row count, a token count or bucket), not a shape of
# the model: fla's gate cumsum keys on `B`, its l2 norm on `NB`.
SIZE_NAMES = frozenset({"B", "T", "N", "M", "NB", "NT"})


def similar(key: Sequence, other: Sequence, names: Sequence[str] | None = None) -> bool:
    """Two autotune keys of one kernel that differ only in sizes: integer entries whose key
    names (`names`, the autotuner's `keys`, in order) are in SIZE_NAMES. Head counts, widths,
    chunk sizes, flags and dtypes must be equal. Without names, no entry counts as a size."""
    if len(key) != len(other) or tuple(key) == tuple(other):
        return False
    names = list(names or ())
    for i, (a, b) in enumerate(zip(key, other)):
        if a == b and type(a) is type(b):
            continue
        if not (type(a) is int and type(b) is int and i < len(names) and names[i] in SIZE_NAMES):
            return False
    return True


def autotune_key(tuner: Any, kwargs: dict) -> tuple[tuple, list[str]]:
    """The key Triton's Autotuner.run builds for this call (its key args by name, then the
    dtypes of its tensor args), and the names of the key's leading entries."""
    nargs = getattr(tuner, "nargs", None) or {}
    args = {k: v for k, v in {**nargs, **kwargs}.items() if k in tuner.arg_names}
    names = [k for k in tuner.keys if k in args]
    key = [args[k] for k in names] + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
    return tuple(key), names


def _config_values(c: Any) -> dict:
    """A Triton config's block sizes and launch options as one dict."""
    return c.all_kwargs() if hasattr(c, "all_kwargs") else {**c.kwargs, **{
        k: getattr(c, k, None) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")}}


def _same_config(a: Any, b: Any) -> bool:
    try:
        return a is b or _config_values(a) == _config_values(b)
    except Exception:
        return False


# Fewer candidates where many are far off: fla's two memory-bound kernels and its fused
# kkt + triangular solve (the tuning a first launch pays is mostly compiling candidates, ~0.5 s
# each). In one H200's timings (docs/results/h200-round6/b-autotune.json) the kept candidates
# held each kernel's winner and no dropped one was faster (conv, kkt + solve: every dropped one
# >= 3.2x slower; l2 norm: many within 2%). End to end on one H200 (docs/benchmarks.md, round 6
# c): a 27B hybrid's first load 65.8 -> 56.6 s; the timings beside the regions' compile are noisy.
# FLEET_FULL_TUNING=1 tunes every candidate.
FEWER: dict[str, Callable[[Any], bool]] = {
    "l2norm_fwd_kernel": lambda c: c.num_warps <= 4 and c.kwargs.get("BT", 8) <= 32,
    "causal_conv1d_fwd_kernel": lambda c: c.num_warps in (8, 16),
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel": lambda c: c.num_warps <= 2,
}


# Winners measured for the 27B hybrid's kernels (64 layers, 16 key / 48 value heads of 128, conv
# width 10,240), per GPU model as torch names it: each kernel's key (None where it holds a size)
# and the config that timed fastest. H200: every candidate timed, nothing else on the GPU
# (docs/results/h200-round6/b-autotune.json); H100: a first launch's own picks among FEWER's
# candidates (docs/results/h100-round11/h100-presets.json, by bench/tuning_presets.py), and for the
# keys of worker.gdn's split layers (q and k at 16 heads, three convolutions) a first launch's own
# picks too (docs/results/h100-round12/presets-fleet-call2.json; the H200 has none yet: it tunes
# them). A host of that GPU running those shapes compiles the winner and times nothing (a 27B
# first launch's LOADING 66.5 -> 42.8 s on an H100, docs/benchmarks.md); any other key, GPU or fla version tunes
# as before. FLEET_FULL_TUNING=1 turns this off with FEWER; FLEET_TUNING_PRESETS adds a file's.
_BF16, _F32 = "torch.bfloat16", "torch.float32"
_HEADS = (48, 48, 128, 128, 64, False)
_SPLIT = (16, 48, 128, 128, 64, False)        # worker.gdn's split layers: q and k at their 16 key heads
PRESETS: dict[str, dict[str, list[tuple[tuple, dict]]]] = {
    "NVIDIA H200": {
        "causal_conv1d_fwd_kernel": [((10240, 4, _BF16, _BF16, _BF16), {"BD": 64, "num_warps": 8, "num_stages": 3})],
        "chunk_fwd_kernel_o": [(_HEADS + (_BF16, _BF16, _BF16, _BF16, _F32, _BF16),
                                {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3})],
        "chunk_gated_delta_rule_fwd_kkt_solve_kernel": [((48, 48, 128, 16, _BF16, _F32, _BF16, _BF16),
                                                         {"BK": 64, "num_warps": 1, "num_stages": 3})],
        "recompute_w_u_fwd_kernel": [((48, 48, 128, 128, 64, 64, 64, False) + (_BF16,) * 6 + (_F32,),
                                      {"num_warps": 4, "num_stages": 4})],
        "chunk_local_cumsum_scalar_kernel": [((None, 48, 64, False, False, _F32, _F32),
                                              {"num_warps": 2, "num_stages": 3})],
        "l2norm_fwd_kernel": [((128, None, _BF16, _BF16, _F32), {"BT": 8, "num_warps": 4, "num_stages": 3})],
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": [(_HEADS + (_BF16, _BF16, _BF16, _BF16, _F32, _BF16),
                                                            {"BV": 64, "num_warps": 4, "num_stages": 2})],
    },
    "NVIDIA H100 80GB HBM3": {
        "causal_conv1d_fwd_kernel": [((10240, 4, _BF16, _BF16, _BF16), {"BD": 128, "num_warps": 16, "num_stages": 3}),
                                     ((6144, 4, _BF16, _BF16, _BF16), {"BD": 32, "num_warps": 8, "num_stages": 3}),
                                     ((2048, 4, _BF16, _BF16, _BF16), {"BD": 32, "num_warps": 16, "num_stages": 3})],
        "chunk_fwd_kernel_o": [(heads + (_BF16, _BF16, _BF16, _BF16, _F32, _BF16),
                                {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3}) for heads in (_HEADS, _SPLIT)],
        "chunk_gated_delta_rule_fwd_kkt_solve_kernel": [((h, 48, 128, 16, _BF16, _F32, _BF16, _BF16),
                                                         {"BK": 32, "num_warps": 1, "num_stages": 3}) for h in (48, 16)],
        "recompute_w_u_fwd_kernel": [((h, 48, 128, 128, 64, 64, 64, False) + (_BF16,) * 6 + (_F32,),
                                      {"num_warps": 4, "num_stages": 3}) for h in (48, 16)],
        "chunk_local_cumsum_scalar_kernel": [((None, 48, 64, False, False, _F32, _F32),
                                              {"num_warps": 8, "num_stages": 3})],
        "l2norm_fwd_kernel": [((128, None, _BF16, _BF16, _F32), {"BT": 16, "num_warps": 4, "num_stages": 3})],
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": [(heads + (_BF16, _BF16, _BF16, _BF16, _F32, _BF16),
                                                            {"BV": 64, "num_warps": 4, "num_stages": 4})
                                                           for heads in (_HEADS, _SPLIT)],
    },
}
# Where a kernel's autotune key holds a size (fla 0.6: the gate cumsum's row count B, the l2 norm's
# token bucket NB), for presets taken from a cache file, which records the key without its names.
SIZE_POSITIONS: dict[str, tuple[int, ...]] = {"chunk_local_cumsum_scalar_kernel": (0,), "l2norm_fwd_kernel": (1,)}
GPU_NAME: list[str | None] = [None]      # the GPU this process tunes on (install's `gpu_name`)
PRESETS_FILE = "FLEET_TUNING_PRESETS"    # a JSON file of more presets, as bench/tuning_presets.py writes
_PRESETS_READ: set[str] = set()


def load_presets(path: str) -> int:
    """Add the presets of a JSON file ({gpu: {kernel: [[key, config], ...]}}, null where a key
    holds a size) to PRESETS; how many. A file that cannot be read adds none."""
    import json
    try:
        with open(path) as f:
            found = json.load(f)
        added = 0
        for gpu, kernels in found.items():
            for kernel, entries in kernels.items():
                for key, config in entries:
                    PRESETS.setdefault(gpu, {}).setdefault(kernel, []).insert(0, (tuple(key), dict(config)))
                    added += 1
        return added
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def kernel_name(tuner: Any, default: str = "") -> str:
    """The name of the Triton kernel an autotuner tunes (Triton 3 wraps it as `base_fn`)."""
    fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
    return getattr(fn, "__name__", default)


def full_tuning() -> bool:
    """FLEET_FULL_TUNING=1: every candidate timed, no presets, no FEWER."""
    return os.environ.get("FLEET_FULL_TUNING") == "1"


def preset(kernel: str, key: Sequence, configs: list) -> Any:
    """The candidate PRESETS names for this kernel, key and this process's GPU, or None (then it
    is tuned)."""
    for pattern, wanted in PRESETS.get(GPU_NAME[0] or "", {}).get(kernel, ()):
        if len(pattern) == len(key) and all(p is None or (p == k and type(p) is type(k))
                                            for p, k in zip(pattern, key)):
            for c in configs:
                values = _config_values(c)
                if all(values.get(k) == v for k, v in wanted.items()):
                    return c
    return None


def fewer(tuner: Any, configs: list) -> list:
    """`configs` limited by FEWER for this autotuner's kernel (all of them if none would stay)."""
    if full_tuning():
        return configs
    keep = FEWER.get(kernel_name(tuner))
    if keep is None:
        return configs
    try:
        kept = [c for c in configs if keep(c)]
    except Exception:
        return configs
    return kept or configs


def reuse_prune(prune: Callable) -> Callable:
    """Wrap Autotuner.prune_configs: when the autotuner has already tuned a key `similar` to this
    call's, only that key's winner is left, so Triton takes it without timing (one config left:
    nothing to time). Anything unexpected falls back to the ordinary tuning."""
    def prune_configs(self, kwargs, *args, **kw):
        configs = prune(self, kwargs, *args, **kw)
        try:
            if len(configs) > 1 and not full_tuning():
                chosen = preset(kernel_name(self), autotune_key(self, kwargs)[0], configs)
                if chosen is not None:
                    STATS["preset"] += 1
                    return [chosen]
            configs = fewer(self, configs)
            cache = getattr(self, "cache", None)
            if len(configs) > 1 and cache:
                key, names = autotune_key(self, kwargs)
                for other, best in list(cache.items()):
                    if similar(other, key, names):
                        chosen = next((c for c in configs if _same_config(c, best)), None)
                        if chosen is not None:
                            STATS["reused"] += 1
                            return [chosen]
            if len(configs) > 1:
                STATS["tuned"] += 1
        except Exception:
            pass
        return configs
    setattr(prune_configs, "_fleet_reuse", True)     # install's mark: this one is ours
    return prune_configs


def brief_bench(bench: Callable, warmup_ms: int = 5, rep_ms: int = 20) -> Callable:
    """Wrap Autotuner._bench: each candidate timed for `warmup_ms` + `rep_ms` (Triton 2.x reads
    num_warmups/num_reps, 3.x its do_bench)."""
    def quick(kernel_call, quantiles=None, **_):
        import triton.testing
        return triton.testing.do_bench(kernel_call, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles)

    def _bench(self, *args, **kwargs):
        saved = {k: self.__dict__[k] for k in ("do_bench", "num_warmups", "num_reps") if k in self.__dict__}
        self.__dict__.update(do_bench=quick, num_warmups=warmup_ms, num_reps=rep_ms)
        try:
            return bench(self, *args, **kwargs)
        finally:
            for k in ("do_bench", "num_warmups", "num_reps"):
                self.__dict__.pop(k, None)
            self.__dict__.update(saved)
    setattr(_bench, "_fleet_brief", True)
    return _bench


def timed_run(run: Callable) -> Callable:
    """Wrap Autotuner.run: the seconds of each call that tuned (timed candidates) add to
    SECONDS under the kernel's name, for the load's report."""
    def run_and_time(self, *args, **kwargs):
        tuned = STATS["tuned"]
        t0 = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            if STATS["tuned"] > tuned:
                # typeshed types a Counter's counts as int; Python's docs allow floats (and `+=` on them)
                SECONDS[kernel_name(self, "?")] += time.perf_counter() - t0  # type: ignore[assignment]
    setattr(run_and_time, "_fleet_timed", True)
    return run_and_time


SECONDS: Counter = Counter()     # kernel name -> seconds spent tuning it in this process


def tuning_report(top: int = 3) -> str:
    """"7 tuned or read from the host's cache in 41 s: kernel_a 20 s, ...; 46 sizes reused" for
    the load's path (a key found in Triton's on-disk cache is not timed again)."""
    slow = ", ".join(f"{k.removesuffix('_kernel')} {v:.0f} s" for k, v in SECONDS.most_common(top))
    took = f" in {sum(SECONDS.values()):.0f} s: {slow}" if SECONDS else ""
    taken = f"{STATS['preset']} taken from the presets for this GPU, " if STATS["preset"] else ""
    return f"{taken}{STATS['tuned']} tuned or read from the host's cache{took}; {STATS['reused']} sizes reused"


def install(autotuner: type | None = None, gpu_name: str | None = None) -> bool:
    """Reuse across sizes and brief timing for every Triton autotuner of this process (see the
    module's doc). `autotuner`: the class to patch (tests pass a stand-in); default Triton's.
    `gpu_name`: the GPU's model, for PRESETS (default: CUDA's current device, if any).
    False without Triton."""
    if gpu_name is None and torch.cuda.is_available():
        try:
            gpu_name = torch.cuda.get_device_name()
        except Exception:
            gpu_name = None
    GPU_NAME[0] = gpu_name or GPU_NAME[0]
    if (path := os.environ.get(PRESETS_FILE)) and path not in _PRESETS_READ:
        _PRESETS_READ.add(path)
        load_presets(path)
    if autotuner is None:
        try:
            from triton.runtime.autotuner import Autotuner
        except Exception:
            return False
        autotuner = Autotuner
    # patched by its attributes' names: Triton's class is untyped, and a stand-in declares none
    patched: Any = autotuner
    if not getattr(patched.prune_configs, "_fleet_reuse", False):
        patched.prune_configs = reuse_prune(patched.prune_configs)
    if hasattr(patched, "_bench") and not getattr(patched._bench, "_fleet_brief", False):
        patched._bench = brief_bench(patched._bench)
    if not getattr(patched.run, "_fleet_timed", False):
        patched.run = timed_run(patched.run)
    return True


def batch_shapes(lengths: Iterable[int], budget: int, pad: int, bucket_rows: bool = False
                 ) -> list[tuple[int, int]]:
    """The distinct (rows, width) of the batches `make_batches` makes of rows of these lengths,
    the shape holding the most tokens first (where the kernels tune), then by tokens."""
    tokens: Counter = Counter()
    for batch in length_batches(list(lengths), budget, pad, bucket_rows):
        shape = (len(batch), padded_length(max(r.length for r in batch), pad))
        tokens[shape] += shape[0] * shape[1]
    return [shape for shape, _ in sorted(tokens.items(), key=lambda kv: (-kv[1], kv[0]))]


def linear_attention_block(config: Any, device: torch.device, dtype: torch.dtype,
                           seed: int = 0) -> torch.nn.Module | None:
    """One linear-attention (Gated DeltaNet) block of the model's own class on `device`, None when
    the architecture has none. Built on the meta device and filled from a private generator: the
    global RNG, which the model's random-weights build beside it draws from, is left alone."""
    import inspect

    from transformers import AutoModel
    text = getattr(config, "text_config", None) or config
    cls = None
    try:
        model_cls = AutoModel._model_mapping[type(config)]
        module = inspect.getmodule(model_cls)
        cls = next((v for k, v in vars(module).items() if k.endswith("GatedDeltaNet") and isinstance(v, type)), None)
    except Exception:
        pass
    if cls is None:
        return None
    types = list(getattr(text, "layer_types", None) or [])
    index = types.index("linear_attention") if "linear_attention" in types else 0
    with torch.device("meta"):
        block = cls(text, index)
    block = block.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return block.eval()


def run_block(block: torch.nn.Module, shapes: Sequence[tuple[int, int]], device: torch.device,
              step: Callable[[int], None] | None = None) -> float:
    """The block once per (rows, width): fla's kernels tune at the first shape and compile their
    specialisations at the others. Seconds."""
    hidden = getattr(block, "hidden_size", None) or cast("GatedDeltaNetParts", block).in_proj_qkv.in_features
    dtype = next(block.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, (rows, width) in enumerate(shapes):
            if step:
                step(i)
            x = torch.randn((rows, width, hidden), generator=g, device=device, dtype=dtype)
            block(hidden_states=x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def linear_attention_aside(model: torch.nn.Module):
    """Inside this block the model's linear-attention (Gated DeltaNet) blocks return zeros of
    their input's shape without running: the rest of each layer (the regions compile_regions
    compiles) can run, and compile, while fla's kernels tune in the Tuner's thread. The blocks'
    own forwards are back on exit."""
    from .gdn import linear_attention_layers
    blocks = [(m, m.__dict__.get("forward")) for m in linear_attention_layers(model)]

    def aside(hidden_states=None, *args, **kwargs):
        return torch.zeros_like(hidden_states if hidden_states is not None else args[0])
    for m, _ in blocks:
        m.forward = aside
    try:
        yield len(blocks)
    finally:
        for m, forward in blocks:
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


class Tuner:
    """fla's tuning for one shard, in a thread beside the weights' build (see the module's doc).
    `lengths()` returns the shard's row lengths to plan for (its first read window); `report(i, n)`
    is called before each shape. `join()` waits; `error` then holds what the thread raised, if
    anything (the load goes on: the kernels tune on first use)."""

    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype,
                 lengths: Callable[[], list[int]], budget: int, pad: int, bucket_rows: bool,
                 report: Callable[[int, int], None] | None = None, max_shapes: int = 400):
        self.config, self.device, self.dtype = config, device, dtype
        self.lengths, self.budget, self.pad, self.bucket_rows = lengths, budget, pad, bucket_rows
        self.report, self.max_shapes = report, max_shapes
        self.shapes: list[tuple[int, int]] = []
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.ran = False
        self._thread = threading.Thread(target=self._run, name="fla-tuning", daemon=True)

    def start(self) -> "Tuner":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            install()
            shapes = batch_shapes(self.lengths(), self.budget, self.pad, self.bucket_rows)
            self.shapes = shapes[: self.max_shapes]
            if not self.shapes:
                return
            block = linear_attention_block(self.config, self.device, self.dtype)
            if block is None:
                return
            from .gdn import use_split_projections
            from .model import use_fla_conv_on
            use_fla_conv_on([block])
            use_split_projections([block])      # the kernels the model's layers will run
            n, report = len(self.shapes), self.report      # set once, in __init__
            run_block(block, self.shapes, self.device, (lambda i: report(i, n)) if report else None)
            self.ran = True
            del block
        except BaseException as e:              # reported by join(); the load goes on without it
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> "Tuner":
        self._thread.join()
        return self


@contextlib.contextmanager
def quick_tuning(warmup_ms: int = 5, rep_ms: int = 20):
    """Triton's autotuner times every candidate config for 25 + 100 ms; fla has several kernels of
    many configs each, tuned again per batch row count, which made a 27B hybrid's first load
    spend minutes timing. Inside this block each candidate is timed for `warmup_ms` + `rep_ms`
    (the winner is clear at that length: the candidates differ by far more than the noise). A
    no-op without Triton; the attributes set are those of Triton 2.x (num_warmups, num_reps) and
    3.x (do_bench)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:
        yield
        return
    bench = Autotuner._bench
    Autotuner._bench = brief_bench(bench, warmup_ms, rep_ms)
    try:
        yield
    finally:
        Autotuner._bench = bench
