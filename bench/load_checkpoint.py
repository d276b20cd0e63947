"""A real checkpoint read onto the GPU (issue 38): how fast the worker's load is against the disk.

Saves a checkpoint of a bench shape (random weights, the CausalLM class, so the files are what a
Hugging Face download holds: safetensors shards with an index), then, each in a fresh process:

- `disk`: the files read sequentially in 16 MiB blocks (what the disk gives; `cat` would say the same);
- `naive`: `AutoModel.from_pretrained(dir, dtype=bf16).to("cuda")`, what a script does;
- `worker`: `worker.model.load_model(dir, "cuda:0", bf16)`, what a shard does at LOADING;
  `worker8`, `worker16`: the same with transformers' loading pool at 8 and 16 threads (its 4 by default);

cold (the files evicted from the page cache first: `drop_caches` where allowed, else
posix_fadvise DONTNEED on each file) and warm (read once just before). Each figure is the
checkpoint's bytes over the seconds, with the process's peak RSS.

    python bench/load_checkpoint.py --shape dense7b --shape hybrid7b --json $OUT/load.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.reference_checks import SHAPES  # noqa: E402

BLOCK = 16 << 20

SAVE = """
import sys, json, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.for_model(**json.load(open(sys.argv[1] + "/config.json")))
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1], max_shard_size="5GB")
"""

LOAD = """
import sys, time, json, resource, torch
sys.path.insert(0, sys.argv[3])
how, path = sys.argv[1], sys.argv[2]
gpu = torch.cuda.is_available()                  # (a CPU runs it too: --shape tiny, a smoke test)
dev = "cuda:0" if gpu else "cpu"
torch.empty(1, device=dev)
reads = []
from transformers import AutoModel
from worker.model import load_model
if how.startswith("worker") and how != "worker":  # worker<N>: transformers' loading pool at N threads
    import transformers.core_model_loading as loading
    loading.GLOBAL_WORKERS = int(how[len("worker"):])
t0 = time.perf_counter()
if how == "naive":
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).to(dev)
else:
    model = load_model(path, dev, torch.bfloat16, on_read=lambda d, t, r: reads.append(d), interval=1.0)
if gpu:
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "gpu_bytes": torch.cuda.memory_allocated() if gpu else None, "progress_events": len(reads)}))
"""


def files_of(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


def evict(path: str) -> str:
    """The checkpoint out of the page cache; how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for name in files_of(path):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def read_all(path: str) -> float:
    t0 = time.perf_counter()
    for name in files_of(path):
        with open(name, "rb", buffering=0) as f:
            while f.read(BLOCK):
                pass
    return time.perf_counter() - t0


def load(how: str, path: str) -> dict:
    r = subprocess.run([sys.executable, "-c", LOAD, how, path, REPO], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_shape(shape: str, work: str) -> dict:
    path = os.path.join(work, shape)
    os.makedirs(path)
    json.dump(SHAPES[shape], open(os.path.join(path, "config.json"), "w"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", SAVE, path], check=True)
    size = sum(os.path.getsize(f) for f in files_of(path))
    out = {"shape": shape, "bytes": size, "files": len(files_of(path)), "save_s": round(time.perf_counter() - t0, 1)}
    runs = []
    for cache in ("cold", "warm"):
        for how in ("disk", "naive", "worker", "worker8", "worker16"):
            if cache == "cold":
                out["evicted_by"] = evict(path)
            else:
                read_all(path)
            if how == "disk":
                got = {"seconds": read_all(path)}
            else:
                got = load(how, path)
            if "seconds" in got:
                got["gb_per_s"] = round(size / got["seconds"] / 1e9, 2)
                got["seconds"] = round(got["seconds"], 2)
            runs.append({"how": how, "cache": cache, **got})
            print(shape, cache, how, got, flush=True)
    out["runs"] = runs
    shutil.rmtree(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES))
    p.add_argument("--work", default=None, help="where the checkpoint is saved (default: a temporary folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fleet-load-", dir=args.work)
    try:
        import torch
        result = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "cpus": os.cpu_count(),
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                  "shapes": [bench_shape(s, work) for s in args.shape or ["dense7b"]]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
