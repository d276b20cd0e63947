"""The worker's fast path on the CPU: compiled decoder layers agree with eager within bf16
tolerance, the compile is cached in the run's folder for the next process, and a machine that
cannot compile falls back to eager with an event saying why."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_events, run_worker


def loaded(state: str) -> dict:
    return next(e for e in read_events(state) if e["event"] == "loaded")


@pytest.fixture(scope="module")
def compile_runs(tmp_path_factory, dense_model, token_data) -> dict:
    """name -> (out, state): a worker run eager, one compiled into a fresh cache, one compiled again
    from that cache, in fp32. Read by two tests (each was a compile of its own)."""
    tmp_path = tmp_path_factory.mktemp("compile-runs")
    cache = str(tmp_path / "cache")
    runs = {}
    for name, extra in (("eager", ("--compile", "off")), ("compiled", ("--compile", "on", "--cache-dir", cache)),
                        ("again", ("--compile", "on", "--cache-dir", cache))):
        out, state = str(tmp_path / name), str(tmp_path / f"state-{name}")
        r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                       "--model-dtype", "fp32", *extra)
        assert r.returncode == 0, r.stderr
        runs[name] = (out, state)
    return {"cache": cache, **runs}


def test_compiled_layers_agree_with_eager_and_the_compile_is_cached(compile_runs):
    """In fp32 the compiled path computes the same function as eager (fused kernels round
    differently, far below bf16's resolution); the files are bf16 either way."""
    cache = compile_runs["cache"]
    runs = {name: (compile_runs[name][0], loaded(compile_runs[name][1])["path"])
            for name in ("eager", "compiled", "again")}
    assert runs["eager"][1] == "eager (--compile off)"
    assert runs["compiled"][1].startswith("compiled (") and f"cache {cache}/inductor" in runs["compiled"][1]
    assert runs["again"][1].startswith("compiled (")
    assert glob.glob(os.path.join(cache, "inductor", "**", "*.py"), recursive=True)    # the shared cache
    files = sorted(glob.glob(os.path.join(runs["eager"][0], "hs_*.safetensors")))
    assert len(files) == 60
    worst = 0.0
    for path in files:
        ref = load_file(path)["hidden_states"].float()
        for other in ("compiled", "again"):
            got = load_file(path.replace(runs["eager"][0], runs[other][0]))["hidden_states"].float()
            worst = max(worst, float((got - ref).norm() / ref.norm()))
    assert worst < 4e-3, worst                     # bf16 files: one rounding of the same values


def test_a_host_that_cannot_compile_runs_eager_and_says_why(tmp_path, dense_model, token_data):
    state = str(tmp_path / "state")
    env = {**os.environ, "CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}
    r = run_worker("--model", dense_model, "--data", token_data, "--out", str(tmp_path / "out"), "--state", state,
                   "--compile", "on", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert r.returncode == 0, r.stderr
    assert loaded(state)["path"].startswith("eager (torch.compile failed: ")
    warnings = [e["message"] for e in read_events(state) if e["event"] == "warning"]
    assert any(w.startswith("torch.compile failed, running eager:") for w in warnings), warnings
    assert len(glob.glob(str(tmp_path / "out" / "hs_*.safetensors"))) == 60


def test_compiling_shows_as_loading_with_its_detail(compile_runs):
    """The compile into a fresh cache (compile_runs' "compiled") is a LOADING step with its detail."""
    from fleet.judge import Policy, judge
    from fleet.record import fold
    from fleet.state import State
    from worker import protocol
    state = compile_runs["compiled"][1]
    events = protocol.read_events(os.path.join(state, "events.jsonl"))
    at = next(i for i, e in enumerate(events) if getattr(e, "detail", None) == "compiling the decoder layers")
    launch = [protocol.Launch(t=events[0].t - 1, launch=1)]
    record = fold(launch + events[: at + 1])
    v = judge(record, True, events[at].t + 1, Policy())
    assert v.state == State.LOADING and record.attempt.detail == "compiling the decoder layers"
    assert fold(launch + events).path.startswith("compiled (")


@pytest.mark.slow
def test_hybrid_regions_compiled_agree_with_eager(tmp_path, models, token_data):
    """A hybrid model's regional compile (norms, MLPs, attention compiled; the linear-attention
    blocks eager, their q, k and v projected apart) computes the model's own function: the files agree with eager in fp32 within
    one bf16 rounding, the load says what was compiled, and the compile shows as its own LOADING
    step."""
    runs = {}
    for name, extra in (("eager", ("--compile", "off")),
                        ("regions", ("--compile", "on", "--cache-dir", str(tmp_path / "cache")))):
        out, state = str(tmp_path / name), str(tmp_path / f"state-{name}")
        r = run_worker("--model", models["qwen3_5_text"], "--data", token_data, "--out", out, "--state", state,
                       "--model-dtype", "fp32", *extra, timeout=900)
        assert r.returncode == 0, r.stderr
        runs[name] = (out, loaded(state)["path"], read_events(state))
    assert "norm/MLP/attention modules compiled in" in runs["regions"][1], runs["regions"][1]
    assert "q/k/v projected apart in 6 linear-attention layers" in runs["regions"][1]     # worker.gdn
    details = [e.get("detail") for e in runs["regions"][2] if e["event"] == "loading"]
    assert any(d and d.startswith("compiling the norms, MLPs and attention") for d in details), details
    files = sorted(glob.glob(os.path.join(runs["eager"][0], "hs_*.safetensors")))
    assert len(files) == 60
    worst = max(float((load_file(p.replace(runs["eager"][0], runs["regions"][0]))["hidden_states"].float()
                       - load_file(p)["hidden_states"].float()).norm() / load_file(p)["hidden_states"].float().norm())
                for p in files)
    assert worst < 4e-3, worst


def test_compile_regions_leaves_the_linear_attention_eager_and_matches_the_model(models):
    """worker.model.compile_regions compiles the outermost norm, MLP and attention modules of
    each layer (not the Gated DeltaNet blocks, which hold fla's kernels), and uncompile_layers
    puts every one back."""
    from worker.model import compile_regions, load_model, uncompile_layers
    hybrid = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    n = compile_regions(hybrid)
    compiled = [m for m in hybrid.modules() if "forward" in m.__dict__]
    assert n == len(compiled) > 0
    kinds = {type(m).__name__ for m in compiled}
    assert kinds == {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP", "Qwen3_5Attention"}, kinds
    assert compile_regions(hybrid) == 0                   # once only
    uncompile_layers(hybrid)
    assert not any("forward" in m.__dict__ for m in hybrid.modules())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_unpacked_rows_captures_what_the_models_own_forward_returns(models, arch):
    """worker.model.unpacked_rows (the worker's forwards skip transformers' packed-sequence
    search, a GPU-to-host sync per batch): a padded batch captured inside it holds, row by row,
    the hidden states of the model's own forward of that row alone (outside it, the search on);
    the search answers None for the positions the model numbers itself, which is what the block
    answers without looking; and the search is back after the block, an error inside included."""
    from transformers import masking_utils

    from worker.layers import resolve_layers
    from worker.model import Capture, find_decoder, load_model, unpacked_rows
    model = load_model(models[arch], "cpu", torch.float32)
    L = model.config.num_hidden_layers
    plan = resolve_layers("speculators", L)
    search = masking_utils.find_packed_sequence_indices
    assert search(torch.arange(37)[None].expand(3, -1)) is None
    g = torch.Generator().manual_seed(7)
    lengths = [37, 21, 9]
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.stack([torch.cat([r, r[-1:].expand(max(lengths) - len(r))]) for r in rows])
    capture = Capture(find_decoder(model), plan)
    calls = []
    masking_utils.find_packed_sequence_indices = lambda *a, **k: calls.append(a) or search(*a, **k)
    try:
        with torch.inference_mode(), unpacked_rows():
            model(input_ids=ids, use_cache=False)
            got = capture.take()
        assert calls == []                                   # not searched inside the block
    finally:
        masking_utils.find_packed_sequence_indices = search
        capture.remove()
    worst = 0.0
    with torch.inference_mode():
        for r, row in enumerate(rows):
            hs = model(input_ids=row[None], output_hidden_states=True).hidden_states
            ref = torch.stack([hs[i][0] for i in plan.ids[:-1]], dim=1).float()   # hs[L] is post-norm there
            worst = max(worst, float((got[r, : len(row), :-1].float() - ref).norm() / ref.norm()))
    assert worst < 4e-3, worst                             # bf16 capture of fp32 states: one rounding
    with pytest.raises(RuntimeError):
        with unpacked_rows():
            assert masking_utils.find_packed_sequence_indices is not search
            raise RuntimeError("inside")
    assert masking_utils.find_packed_sequence_indices is search
