"""What the reference checks (worker/reference.py, issue 36) cost, and how close a real GPU run's
written states come to the reference forward.

The real worker (`python -m worker.extract --random-weights`) on one GPU over a synthetic
ShareGPT-like token dataset (mean 728 tokens), with `--reference-checks EVERY` so that a bench of a
few thousand rows checks enough of them: the `checked` events say how many rows were checked, the
seconds they took on the GPU loop and the worst cosine and relative error per layer; the `loaded`
and `done` events bound the extraction. The share of the GPU loop a real run spends on its checks
is then the seconds of one check over 2,000 rows' extraction (the default rate; `share_at_2000`).

    python bench/reference_checks.py --shape dense7b --samples 2000 --every 100 --json dense.json
    python bench/reference_checks.py --shape hybrid27 --samples 1200 --every 100 --json hybrid.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gpu_fleet import HYBRID27, SHAPE, VOCAB  # noqa: E402
from worker.demo import sharegpt_lengths  # noqa: E402

DENSE7B = dict(vocab_size=VOCAB, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
               tie_word_embeddings=False, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
               rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", torch_dtype="bfloat16")
HYBRID7B = {**DENSE7B, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
            "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(36)],
            "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
TINY = {**DENSE7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}          # --shape tiny: the same code paths on a CPU, in seconds
SHAPES = {"dense7b": DENSE7B, "hybrid7b": HYBRID7B, "dense27": SHAPE, "hybrid27": HYBRID27, "tiny": TINY}


def events(state: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(state, "events.jsonl")) if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="dense7b")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fleet-refcheck-")
    os.makedirs(f"{work}/model")
    json.dump(SHAPES[args.shape], open(f"{work}/model/config.json", "w"))
    rng = random.Random(7)
    with open(f"{work}/data.jsonl", "w") as f:
        for n in sharegpt_lengths(rng, args.samples, 728):
            f.write(json.dumps({"input_ids": [rng.randrange(VOCAB) for _ in range(min(n, 8192))]}) + "\n")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "worker.extract", "--model", f"{work}/model", "--data",
                        f"{work}/data.jsonl", "--out", f"{work}/out", "--state", f"{work}/state", "--random-weights",
                        "--reference-checks", str(args.every), "--dtype", args.dtype, "--max-tokens-per-batch", "16384"],
                       cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    evs = events(f"{work}/state")
    loaded = next(e for e in evs if e["event"] == "loaded")
    done = next((e for e in evs if e["event"] == "done"), None)
    checked = [e for e in evs if e["event"] == "checked"]
    last = checked[-1] if checked else {}
    extraction = (done["t"] if done else evs[-1]["t"]) - loaded["t"]
    rows = done["done"] if done else None
    per_check = last.get("seconds", 0.0) / max(last.get("rows", 0), 1)
    per_row = extraction / rows if rows else None
    out = {"shape": args.shape, "dtype": args.dtype, "samples": args.samples, "every": args.every,
           "exit": r.returncode, "wall_s": round(wall, 1), "loading_s": loaded.get("seconds"),
           "path": loaded.get("path"), "extraction_s": round(extraction, 2), "rows": rows,
           "tokens_per_s": round(done["tokens"] / extraction) if done else None,
           "checked_rows": last.get("rows"), "checks_s": last.get("seconds"),
           "per_check_s": round(per_check, 4),
           "share_of_extraction": round(last.get("seconds", 0.0) / extraction, 4) if extraction else None,
           "share_at_2000": round(per_check / (2000 * per_row), 5) if per_row else None,
           "layer_ids": last.get("layer_ids"), "worst_cosine": last.get("worst_cosine"),
           "worst_rel_err": last.get("worst_rel_err"), "failed": last.get("failed"),
           "stderr_tail": r.stderr[-1500:] if r.returncode else ""}
    shutil.rmtree(work, ignore_errors=True)                  # the output is tens of GB: gone once read
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
