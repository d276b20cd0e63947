"""A whole run on one multi-GPU host through fleet: what issue 3 asks, on whatever GPUs there are.

On the GPU machine (a `local` host in fleet.toml; no SSH server there): a random-initialised
decoder the size of a 27B model in bf16 (dense qwen3 shape: 64 layers, hidden 5120, ~27.2B
non-embedding parameters; the worker's --random-weights builds it on each GPU from config.json),
a synthetic ShareGPT-like dataset (lognormal lengths, mean 728 tokens).

  1. scaling: `fleet up --headless` with 1 shard on GPU 0 over --scale-samples, then with one shard
     per GPU over the same count: tokens/s per GPU and aggregate, from the workers' own events;
  2. the main run: one shard per GPU over --samples, `fleet status --json` captured every few
     seconds, SIGKILL one worker mid-run; fleet notices (time to FAILED), restarts it with backoff
     and it resumes (time to its first new sample);
  3. `fleet verify`.

Writes result.json, status.jsonl, headless.log, verify.txt under --out.

    python bench/gpu_fleet.py --out $OUT

`--shape hybrid27`: the 27B Gated-DeltaNet hybrid our first users run (64 layers, hidden 5120,
three linear-attention layers to one full-attention layer, 16 key / 48 value heads of 128), one
shard per GPU through `fleet up --headless`, twice: a first launch on a bare host (empty kernel
caches), then the same run again under a new name (the host's caches warm). For each: the load
(LOADING's seconds), the first minute after it, the steady rate (from the end of that minute), per
minute, and the whole run with its load. The host's caches live under the host's root (`<root>/cache`).

    python bench/gpu_fleet.py --shape hybrid27 --out $OUT --samples 2600

`--shape moe30b`: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts, 8 a token,
moe_intermediate 768; random weights), the same runs as hybrid27, with MFU counting the active
parameters (worker.model.active_parameters: 2.73B of 29.9B); `--budgets` runs each token budget
([run] max_tokens_per_batch) and `--fast both` each budget with the fast kernels off
(FLEET_FAST=0) and on, in the same call:

    python bench/gpu_fleet.py --shape moe30b --out $OUT --samples 3000 --once --budgets 16384,32768 --fast both

flash-linear-attention must be importable by the python that fleet launches the worker with
(`pip install` it there; a PYTHONPATH of the bench's shell does not reach the worker).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.window import window_lengths  # noqa: E402
from worker.batching import length_batches, padding_share  # noqa: E402
from worker.demo import sharegpt_lengths  # noqa: E402

VOCAB = 151936
BUDGET = 16384          # [run] max_tokens_per_batch of the bench's runs: the data's padding is computed for it
SHAPE = dict(vocab_size=VOCAB, hidden_size=5120, intermediate_size=21504, num_hidden_layers=64,
             num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
             tie_word_embeddings=False, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
             rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", torch_dtype="bfloat16")


HYBRID27 = dict(vocab_size=VOCAB, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
                tie_word_embeddings=False, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)],
                full_attention_interval=4, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_num_value_heads=48, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16")


# Qwen3-30B-A3B's shape (its config.json, random weights): 30.5B parameters, 3.3B of them a token
# meets (2.73B without the embeddings).
MOE30B = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, model_type="qwen3_moe",
              architectures=["Qwen3MoeForCausalLM"], rms_norm_eps=1e-6, rope_theta=1000000.0,
              hidden_act="silu", torch_dtype="bfloat16")
SHAPES = {"hybrid27": HYBRID27, "moe30b": MOE30B}


def counted_params(shape: dict) -> int:
    """Non-embedding parameters a token meets in `shape` (all of them, but for an MoE's experts
    the k of E it is routed to), counted on a model built on the meta device."""
    from transformers import AutoConfig

    from worker.model import config_active_parameters
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    return config_active_parameters(config)[1]


def nonembedding_params() -> int:
    H, I, L = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    q = H * SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    kv = 2 * H * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    per_layer = q + kv + q + 3 * H * I + 2 * H + 2 * SHAPE["head_dim"]
    return L * per_layer + H


def make_data(path: str, n: int, seed: int, window: int = 0, pad: int = 16, budget: int = BUDGET) -> dict:
    """A dataset of about `n` random-id rows: ShareGPT-like lengths, or with `window` the rows of
    every k-th batch of one sort window of that many rows (bench/window.py: a real shard's padding).
    Its tokens, rows and the padding share of the batches a shard cuts from it."""
    rng = random.Random(seed)
    lengths = (window_lengths(seed, n, budget, pad, window=window) if window
               else [min(length, 8192) for length in sharegpt_lengths(rng, n, 728)])
    tokens = 0
    with open(path, "w") as f:
        for length in lengths:
            tokens += length
            f.write(json.dumps({"input_ids": [rng.randrange(VOCAB) for _ in range(length)]}) + "\n")
    return {"tokens": tokens, "rows": len(lengths), "window": window or None,
            "padding": round(padding_share(length_batches(lengths, budget, pad), pad), 4)}


PASSED = ("FLEET_TUNING_PRESETS", "FLEET_FULL_TUNING", "FLEET_SPLIT_PROJECTIONS", "FLEET_FAST")     # the bench's environment the workers get


def passed_env(more: dict | None = None) -> str:
    """[run] env for the variables of PASSED set in the bench's environment (and `more`)."""
    env = {**{k: os.environ[k] for k in PASSED if k in os.environ}, **(more or {})}
    pairs = [f"{k} = {json.dumps(v)}" for k, v in env.items()]
    return f"env = {{ {', '.join(pairs)} }}" if pairs else ""


def write_config(path: str, work: str, data: str, output: str, gpus: list[int], name: str,
                 gpus_per_shard: int = 1, extra: tuple[str, ...] = (), dtype: str = "bf16",
                 model: str | None = None, budget: int = BUDGET, env: dict | None = None) -> str:
    """`model`: a saved checkpoint to load (default: `<work>/model`'s config.json, random weights)."""
    extra = tuple(extra) if model else ("--random-weights", *extra)
    with open(path, "w") as f:
        f.write(f"""
[run]
name = "{name}"
model = "{model or work + '/model'}"
data = "{data}"
output = "{output}"
layers = "speculators"
max_tokens_per_batch = {budget}
device = "cuda"
extra_args = {json.dumps(list(extra))}
gpus_per_shard = {gpus_per_shard}
dtype = "{dtype}"
{passed_env(env)}

[expected]
tokens_per_s_per_gpu = 6000

[supervise]
stall_timeout = "300s"
max_restarts = 3
backoff_base = "2s"

[[hosts]]
name = "gpubox"
address = "local"
python = "{sys.executable}"
gpus = {json.dumps(gpus)}
root = "{work}/fleet"
""")
    return path


def fleet(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], cwd=REPO, capture_output=True,
                          text=True, **kw)


def shard_events(work: str, name: str, shard: int) -> list[dict]:
    path = os.path.join(work, "fleet", name, "shards", str(shard), "events.jsonl")
    return [json.loads(l) for l in open(path) if l.strip()]


def steady_rate(events: list[dict]) -> dict:
    """tokens/s of one launch: from its `loaded` event to its last progress (load time excluded)."""
    launches = [i for i, e in enumerate(events) if e["event"] == "launch"]
    out = []
    for n, start in enumerate(launches):
        part = events[start: launches[n + 1] if n + 1 < len(launches) else None]
        loaded = next((e for e in part if e["event"] == "loaded"), None)
        prog = [e for e in part if e["event"] in ("progress", "done") and "tokens" in e]
        if loaded is None or len(prog) < 1:
            continue
        base = next((e for e in reversed(events[:start]) if e["event"] in ("progress", "done")), None)
        tokens0 = base["tokens"] if base else 0
        done0 = base["done"] if base else 0
        last = prog[-1]
        dt = last["t"] - loaded["t"]
        out.append({"load_s": loaded.get("seconds"), "seconds": round(dt, 1),
                    "tokens": last["tokens"] - tokens0, "samples": last["done"] - done0,
                    "tokens_per_s": round((last["tokens"] - tokens0) / dt) if dt > 0 else None,
                    "gpu_peak_gib": round(last.get("gpu_peak_bytes", 0) / 2**30, 1),
                    "writer_wait_s": last.get("writer_wait_s")})
    return {"launches": out}


def minutes(events: list[dict], first_s: float = 60.0) -> dict:
    """A launch's rates from its own events: the load (LOADING's seconds), tokens/s over the
    first minute after `loaded`, the steady rate from the end of that minute to the last
    progress, each minute's rate, and the whole launch (load included) from `started`."""
    started = next(e for e in events if e["event"] == "started")
    loaded = next(e for e in events if e["event"] == "loaded")
    prog = [(loaded["t"], 0)] + [(e["t"], e["tokens"]) for e in events
                                 if e["event"] in ("progress", "done") and "tokens" in e and e["t"] >= loaded["t"]]
    base = next((e["tokens"] for e in reversed(events) if e["event"] in ("progress", "done")
                 and "tokens" in e and e["t"] < loaded["t"]), 0)
    prog = [(t, max(0, n - base)) if i else (t, 0) for i, (t, n) in enumerate(prog)]

    def at(t: float) -> float:                   # tokens written by time t (linear between events)
        for (t0, n0), (t1, n1) in zip(prog, prog[1:]):
            if t0 <= t <= t1:
                return n0 + (n1 - n0) * (t - t0) / max(t1 - t0, 1e-9)
        return prog[-1][1]
    end, total = prog[-1]
    t0 = loaded["t"]
    per_minute = [round((at(t0 + 60 * (k + 1)) - at(t0 + 60 * k)) / 60) for k in range(int((end - t0) // 60))]
    steady = (total - at(t0 + first_s)) / (end - t0 - first_s) if end - t0 > first_s + 10 else None
    # The reference checks (worker/reference.py) run between batches: at least MIN_ROWS a shard, so a
    # short bench run pays for 8 where a real shard pays 1 in 2,000 rows. Their seconds within the
    # steady window (each `checked` event carries the launch's running total) are given apart.
    checks = [(e["t"], e.get("seconds", 0.0)) for e in events if e["event"] == "checked" and e["t"] >= t0]
    check_s = sum(b - a for (_, a), (t, b) in zip([(t0, 0.0)] + checks, checks) if t >= t0 + first_s)
    steady_checks_apart = ((total - at(t0 + first_s)) / (end - t0 - first_s - check_s)
                           if steady and end - t0 - first_s > check_s else None)
    all_check_s = checks[-1][1] if checks else 0.0
    return {"load_s": loaded.get("seconds"), "path": loaded.get("path"),
            "first_minute_tokens_per_s": round(at(t0 + first_s) / min(first_s, end - t0)),
            "steady_tokens_per_s": round(steady) if steady else None, "per_minute": per_minute,
            "checks": len(checks), "check_s_in_steady": round(check_s, 2),
            "steady_tokens_per_s_checks_apart": round(steady_checks_apart) if steady_checks_apart else None,
            "after_load_tokens_per_s_checks_apart": round(total / max(end - t0 - all_check_s, 1e-9)),
            "whole_tokens_per_s_with_load": round(total / (end - started["t"])), "tokens": total,
            "seconds_after_load": round(end - t0, 1),
            "loading_details": [e.get("detail") for e in events if e["event"] == "loading"][-3:],
            "loading_steps": loading_steps(events)}


def loading_steps(events: list[dict]) -> list[list]:
    """Each LOADING step of a launch: seconds since its first loading event, and the detail (a
    run of one kind of step, e.g. "batch shape i of n", is kept at its first and last)."""
    loading = [e for e in events if e["event"] in ("loading", "loaded")]
    if not loading:
        return []
    t0 = loading[0]["t"]
    steps = [[round(e["t"] - t0, 1), e.get("detail") or e["event"]] for e in loading]
    kind = lambda d: str(d).split(":")[0]
    return [s for i, s in enumerate(steps) if i in (0, len(steps) - 1)
            or kind(s[1]) != kind(steps[i - 1][1]) or kind(s[1]) != kind(steps[i + 1][1])]


def runs_of(args) -> list[tuple[str, int, dict]]:
    """(name, token budget, worker env) of each run: hybrid27's first launch and the same again;
    with --budgets or --fast, one first launch per budget and fast setting, in that order."""
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [BUDGET]
    fast = {"both": ["0", "1"], "on": ["1"], "off": ["0"]}.get(args.fast, [])
    if not args.budgets and not fast:
        return [(name, BUDGET, {}) for name in (("first",) if args.once else ("first", "again"))]
    return [(f"b{b}" + (f"-fast{f}" if f else ""), b, {"FLEET_FAST": f} if f else {})
            for b in budgets for f in (fast or [None])]


def one_shape(args, result: dict, peak: float, ngpu: int) -> None:
    """The 27B hybrid (or the MoE) through fleet, one shard per GPU: a first launch on a bare
    host, then the same again with the host's caches warm (or the runs of --budgets / --fast)."""
    work = args.work
    shape = SHAPES[args.shape]
    json.dump(shape, open(f"{work}/model/config.json", "w"))
    params = result["nonembedding_params"] = counted_params(shape)
    result["params_counted"] = "active" if "num_experts" in shape else "all"
    model = None
    if args.checkpoint:                  # a real checkpoint, as a download holds it, read by the load
        from bench.load_checkpoint import SAVE, files_of
        model = args.checkpoint
        os.makedirs(model, exist_ok=True)
        t0 = time.time()
        if not files_of(model):          # (one saved by an earlier call of the bench is used again)
            json.dump(shape, open(f"{model}/config.json", "w"))
            subprocess.run([sys.executable, "-c", SAVE, model], check=True)
        result["checkpoint"] = {"path": model, "bytes": sum(os.path.getsize(f) for f in files_of(model)),
                                "save_s": round(time.time() - t0, 1)}
        print(json.dumps(result["checkpoint"]), flush=True)
    data = f"{work}/data.jsonl"
    from worker.extract import HYBRID_PAD
    extra = tuple(args.worker_args.split())
    pads = argparse.ArgumentParser(add_help=False)
    pads.add_argument("--pad-multiple", type=int, default=HYBRID_PAD if shape is HYBRID27 else 8)   # the worker's
    pad = pads.parse_known_args(extra)[0].pad_multiple
    runs = runs_of(args)
    result["data"] = make_data(data, args.samples, 2, args.window, pad=pad, budget=runs[0][1])
    result["tokens"] = result["data"]["tokens"]
    for name, budget, env in runs:
        cfg = write_config(f"{work}/{name}.toml", work, data, f"{work}/out-{name}", list(range(ngpu)), name,
                           dtype=args.dtype, model=model, extra=extra, budget=budget, env=env)
        t0 = time.time()
        rc, lines, _ = run_headless(cfg, f"{args.out}/{name}.log")
        per = []
        for k in range(ngpu):
            m = minutes(shard_events(work, name, k))
            m["mfu_steady"] = round(2 * params * m["steady_tokens_per_s"] / peak, 3) if m["steady_tokens_per_s"] else None
            m["mfu_first_minute"] = round(2 * params * m["first_minute_tokens_per_s"] / peak, 3)
            if m["steady_tokens_per_s_checks_apart"]:
                m["mfu_steady_checks_apart"] = round(2 * params * m["steady_tokens_per_s_checks_apart"] / peak, 3)
            m["mfu_after_load_checks_apart"] = round(2 * params * m["after_load_tokens_per_s_checks_apart"] / peak, 3)
            per.append(m)
        v = fleet("verify", "-c", cfg)
        result[name] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "per_gpu": per, "verify_rc": v.returncode,
                        "budget": budget, "env": env}
        shutil.rmtree(f"{work}/out-{name}", ignore_errors=True)
        print(json.dumps({name: result[name]}), flush=True)
        json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)


def compare_outputs(a: str, b: str, n: int = 16) -> dict:
    """The same samples written by two runs (bf16 files): how many, how many bit-identical, and
    the largest relative error."""
    import glob

    import torch
    from safetensors.torch import load_file
    worst, files, identical = None, 0, 0
    for path in sorted(glob.glob(os.path.join(a, "hs_*.safetensors")))[:n]:
        other = os.path.join(b, os.path.basename(path))
        if not os.path.exists(other):
            continue
        x, y = load_file(path)["hidden_states"], load_file(other)["hidden_states"]
        files += 1
        identical += bool(torch.equal(x, y))
        err = float((x.float() - y.float()).norm() / y.float().norm())
        worst = err if worst is None else max(worst, err)
    return {"files": files, "identical": identical, "max_rel_err": worst}


def run_headless(config: str, log_path: str, kill: dict | None = None, status_path: str | None = None):
    """fleet up --headless with receipt-stamped lines; optionally SIGKILL a shard mid-run."""
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", "--headless", "-c", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    stop = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    def poll_status():
        with open(status_path, "a") as f:
            while not stop.wait(3.0):
                r = fleet("status", "--json", "-c", config)
                if r.stdout.strip().startswith("{"):
                    f.write(json.dumps(json.loads(r.stdout)) + "\n")
                    f.flush()

    threads = [threading.Thread(target=read, daemon=True)]
    if status_path:
        threads.append(threading.Thread(target=poll_status, daemon=True))
    for t in threads:
        t.start()
    killed = {}
    if kill:
        pid_file = kill["pid_file"]
        while proc.poll() is None:
            if os.path.exists(kill["manifest"]):
                n = sum(1 for _ in open(kill["manifest"]))
                if n >= kill["after"] and os.path.exists(pid_file):
                    pid = int(open(pid_file).read())
                    killed["t"] = time.time()
                    os.kill(pid, signal.SIGKILL)
                    killed["pid"], killed["samples_before"] = pid, n
                    break
            time.sleep(0.2)
    rc = proc.wait()
    stop.set()
    for t in threads:
        t.join(5)
    with open(log_path, "w") as f:
        f.writelines(f"{ts:.3f} {line}\n" for ts, line in lines)
    return rc, lines, killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/fleet-gpu")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--scale-samples", type=int, default=600)
    p.add_argument("--split-only", action="store_true",
                   help="only the shard spanning every GPU: against one shard per GPU, and its files "
                        "against one GPU's run of the same batches")
    p.add_argument("--shape", choices=("dense27", "hybrid27", "moe30b"), default="dense27",
                   help="the dense 27B (scaling, kill and restart, split), the 27B hybrid (first launch "
                        "and a second one on the warm host cache) or Qwen3-30B-A3B's MoE shape (the same runs)")
    p.add_argument("--budgets", default="", help="hybrid27/moe30b: comma list of token budgets, one first launch each")
    p.add_argument("--fast", choices=("", "on", "off", "both"), default="",
                   help="hybrid27/moe30b: each run with the fast kernels on (FLEET_FAST=1), off, or both")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="hidden states as stored")
    p.add_argument("--once", action="store_true", help="hybrid27: the first launch only")
    p.add_argument("--window", type=int, default=0, metavar="ROWS",
                   help="hybrid27/moe30b: the rows of every k-th batch of one sort window of this many rows (20000: "
                        "the worker's), so batches pad as a real shard's do; default: --samples rows sorted alone")
    p.add_argument("--worker-args", default="", help="hybrid27: more worker arguments, e.g. \"--pad-multiple 8\"")
    p.add_argument("--checkpoint", default=None,
                   help="hybrid27: save the model as a real checkpoint here (say /dev/shm/h27: a warm page "
                        "cache) and load it, instead of random weights built on the GPU")
    p.add_argument("--micro-batches", default="2",
                   help="comma list: the spanning shard is run once per value (worker --micro-batches)")
    args = p.parse_args()
    import torch
    ngpu = torch.cuda.device_count()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    peak = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t0)
    del a
    torch.cuda.empty_cache()
    work = args.work
    os.makedirs(args.out, exist_ok=True)        # the runs' logs and result.json land there
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(f"{work}/model")
    json.dump(SHAPE, open(f"{work}/model/config.json", "w"))
    params = nonembedding_params()
    result = {"gpus": ngpu, "gpu_name": torch.cuda.get_device_name(0), "peak_tflops": round(peak / 1e12, 1),
              "nonembedding_params": params, "torch": torch.__version__, "shape": args.shape,
              "fla": __import__("importlib.util").util.find_spec("fla") is not None}
    if args.shape in SHAPES:
        one_shape(args, result, peak, ngpu)
        print(json.dumps(result, indent=1))
        return
    # 1. scaling, 1 GPU then all
    scale_data = f"{work}/scale.jsonl"
    result["scale_tokens"] = make_data(scale_data, args.scale_samples, 1, pad=8)["tokens"]
    result["scaling"] = {}
    for n in ([ngpu] if args.split_only else sorted({1, ngpu})):
        name = f"scale{n}"
        cfg = write_config(f"{work}/{name}.toml", work, scale_data, f"{work}/out-{name}", list(range(n)), name)
        t0 = time.time()
        rc, lines, _ = run_headless(cfg, f"{args.out}/scale{n}.log")
        per = [steady_rate(shard_events(work, name, k)) for k in range(n)]
        rates = [s["launches"][-1]["tokens_per_s"] for s in per]
        result["scaling"][n] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "per_gpu": per,
                                "aggregate_tokens_per_s": sum(rates),
                                "mfu_per_gpu": [round(2 * params * r / peak, 3) for r in rates]}
        shutil.rmtree(f"{work}/out-{name}", ignore_errors=True)
        print(json.dumps({f"scale{n}": result["scaling"][n]}), flush=True)
        json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)   # kept if a later step dies
    # 1b. one shard spanning every GPU (gpus_per_shard), the same samples: against one shard per
    # GPU; its files against one GPU running the very same batches and row groups (the same
    # shapes, so the same kernels: any difference is the split's)
    if ngpu > 1:
        result["split"] = {}
        micro = [int(m) for m in args.micro_batches.split(",")]
        for m in micro:
            name = f"split{m}"
            cfg = write_config(f"{work}/{name}.toml", work, scale_data, f"{work}/out-{name}", list(range(ngpu)),
                               name, gpus_per_shard=ngpu, extra=("--micro-batches", str(m)))
            rc, lines, _ = run_headless(cfg, f"{args.out}/{name}.log")
            per = steady_rate(shard_events(work, name, 0))
            rate = per["launches"][-1]["tokens_per_s"]
            result["split"][m] = {"rc": rc, "micro_batches": m, "per_shard": per, "tokens_per_s": rate,
                                  "mfu_of_all_gpus": round(2 * params * rate / peak / ngpu, 3),
                                  "vs_one_shard_per_gpu": round(rate / result["scaling"][ngpu]["aggregate_tokens_per_s"], 3)}
            print(json.dumps({name: result["split"][m]}), flush=True)
            json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)   # kept if a later step dies
            if m != micro[0]:
                shutil.rmtree(f"{work}/out-{name}", ignore_errors=True)
        name, m = "ref1", micro[0]
        cfg = write_config(f"{work}/{name}.toml", work, scale_data, f"{work}/out-{name}", [0], name,
                           extra=("--micro-batches", str(m)))
        rc, lines, _ = run_headless(cfg, f"{args.out}/{name}.log")
        result["exactness"] = {"rc": rc, "micro_batches": m,
                               "max_rel_err_split_vs_one_gpu_same_batches":
                                   compare_outputs(f"{work}/out-split{m}", f"{work}/out-{name}", n=64)}
        print(json.dumps({"exactness": result["exactness"]}), flush=True)
        json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)   # kept if a later step dies
        for d in (f"{work}/out-split{m}", f"{work}/out-{name}"):
            shutil.rmtree(d, ignore_errors=True)
    if args.split_only:
        json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)
        print(json.dumps(result, indent=1))
        return
    # 2. the main run with a SIGKILL
    data = f"{work}/data.jsonl"
    result["tokens"] = make_data(data, args.samples, 2, pad=8)["tokens"]
    cfg = write_config(f"{work}/main.toml", work, data, f"{work}/out", list(range(ngpu)), "main")
    victim = ngpu - 1
    kill = {"pid_file": f"{work}/fleet/main/shards/{victim}/pid",
            "manifest": f"{work}/out/manifest/{victim}.jsonl", "after": args.samples // ngpu // 3}
    t0 = time.time()
    rc, lines, killed = run_headless(cfg, f"{args.out}/headless.log", kill, f"{args.out}/status.jsonl")
    result["main"] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "killed": killed}
    if killed:
        failed = next((ts for ts, l in lines if f"shard {victim} " in l and ("-> BACKOFF" in l or "-> FAILED" in l)
                       and ts >= killed["t"]), None)
        ev = shard_events(work, "main", victim)
        relaunch = [e for e in ev if e["event"] == "launch"][-1]
        after = [e for e in ev if e["t"] > relaunch["t"]]
        loaded = next((e for e in after if e["event"] == "loaded"), None)
        first = next((e for e in after if e["event"] == "progress" and e["done"] > killed["samples_before"]), None)
        result["main"]["kill_to_failed_s"] = round(failed - killed["t"], 2) if failed else None
        result["main"]["kill_to_relaunch_s"] = round(relaunch["t"] - killed["t"], 2)
        result["main"]["relaunch_to_loaded_s"] = round(loaded["t"] - relaunch["t"], 2) if loaded else None
        result["main"]["kill_to_new_samples_s"] = round(first["t"] - killed["t"], 2) if first else None
    per = [steady_rate(shard_events(work, "main", k)) for k in range(ngpu)]
    result["main"]["per_gpu"] = per
    v = fleet("verify", "-c", cfg)
    with open(f"{args.out}/verify.txt", "w") as f:
        f.write(v.stdout + v.stderr)
    result["verify_rc"] = v.returncode
    json.dump(result, open(f"{args.out}/result.json", "w"), indent=2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
