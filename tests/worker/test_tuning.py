"""worker.tuning on the CPU: an autotuner tunes a kernel once and takes that winner for other
sizes (not for other model shapes), the shard's batch shapes are those make_batches makes, and
the tuning block of the model's own class computes what the model's layer computes, in a thread,
without touching the global RNG that the random-weights build beside it draws from."""

from __future__ import annotations

import random

import torch

from worker.batching import make_batches, padded_length
from worker.tuning import Tuner, autotune_key, batch_shapes, install, linear_attention_block, run_block, similar


class Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def all_kwargs(self):
        return dict(self.kwargs)


class FakeAutotuner:
    """The part of Triton's Autotuner.run that decides whether to time: a key from the args by
    name then the tensors' dtypes; prune_configs; one config left is taken without timing."""

    def __init__(self, arg_names, keys, configs):
        self.arg_names, self.keys, self.configs = arg_names, keys, configs
        self.cache, self.timed = {}, []

    def prune_configs(self, kwargs):
        return self.configs

    def _bench(self, *args, config, **meta):
        self.timed.append(config)
        return [float(config.kwargs["BT"] != 32)]          # BT=32 is the fastest

    def run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        key, _ = autotune_key(self, kwargs)
        if key not in self.cache:
            pruned = self.prune_configs(kwargs)
            if len(pruned) == 1:
                self.cache[key] = pruned[0]
            else:
                timings = {c: self._bench(*args, config=c, **kwargs) for c in pruned}
                self.cache[key] = min(timings, key=timings.get)
        self.nargs = None
        return self.cache[key]


def test_a_kernel_tunes_once_and_other_sizes_take_its_winner():
    install(FakeAutotuner)
    install(FakeAutotuner)                                  # idempotent
    configs = [Config(BT=bt) for bt in (16, 32, 64)]
    tuner = FakeAutotuner(["x", "B", "H", "NB"], ["B", "H", "NB"], configs)
    x = torch.zeros(2, dtype=torch.bfloat16)
    best = tuner.run(x, 8, 16, 4)
    assert best.kwargs == {"BT": 32} and len(tuner.timed) == 3
    assert tuner.run(x, 3, 16, 1) is best and len(tuner.timed) == 3      # other sizes: no timing
    assert tuner.run(x, 8, 48, 4) is best and len(tuner.timed) == 6      # another head count: tuned
    assert tuner.run(x.float(), 8, 16, 4) is best and len(tuner.timed) == 9   # another dtype: tuned


def test_a_preset_for_this_gpu_is_taken_without_timing_and_nothing_else_is(monkeypatch):
    """PRESETS: the 27B's l2 norm on an H200 takes the measured winner for any token bucket (NB
    is a size), times nothing; another head width, another GPU, or FLEET_FULL_TUNING tunes."""
    from worker import tuning

    def l2norm_fwd_kernel():                    # the kernel's name is what the presets are keyed by
        pass
    configs = [Config(BT=bt, num_warps=w, num_stages=3) for bt in (8, 16, 32) for w in (2, 4)]
    winner = tuning.PRESETS["NVIDIA H200"]["l2norm_fwd_kernel"][0][1]
    x, y, z = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)

    def tuner():
        t = FakeAutotuner(["x", "y", "z", "D", "NB"], ["D", "NB"], configs)
        t.fn = l2norm_fwd_kernel
        return t
    monkeypatch.setattr(tuning, "GPU_NAME", [None])
    install(FakeAutotuner, gpu_name="NVIDIA H200")
    t = tuner()
    best = t.run(x, y, z, 128, 12)
    assert best.kwargs == winner and t.timed == []
    assert t.run(x, y, z, 128, 3).kwargs == winner and t.timed == []          # another bucket: a size
    assert t.run(x, y, z, 64, 12).kwargs["BT"] == 32 and len(t.timed) == 6    # another width: tuned
    install(FakeAutotuner, gpu_name="NVIDIA A100-SXM4-80GB")
    t = tuner()
    assert t.run(x, y, z, 128, 12).kwargs["BT"] == 32 and len(t.timed) == 6   # another GPU: tuned
    install(FakeAutotuner, gpu_name="NVIDIA H200")
    monkeypatch.setenv("FLEET_FULL_TUNING", "1")
    t = tuner()
    assert t.run(x, y, z, 128, 12).kwargs["BT"] == 32 and len(t.timed) == 6   # switched off: tuned


def test_presets_from_a_file_of_a_hosts_timings_are_taken_on_its_gpu(tmp_path, monkeypatch):
    """FLEET_TUNING_PRESETS (what bench/tuning_presets.py writes from a host's Triton cache)."""
    import json

    from worker import tuning

    def chunk_fwd_kernel_o():
        pass
    configs = [Config(BK=bk, num_warps=4, num_stages=3) for bk in (32, 64)]
    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"NVIDIA Stand-in": {"chunk_fwd_kernel_o": [[[7, None, "torch.bfloat16"],
                                                                              {"BK": 64, "num_warps": 4}]]}}))
    monkeypatch.setattr(tuning, "GPU_NAME", [None])
    monkeypatch.setattr(tuning, "PRESETS", {})
    monkeypatch.setenv(tuning.PRESETS_FILE, str(path))
    install(FakeAutotuner, gpu_name="NVIDIA Stand-in")
    t = FakeAutotuner(["x", "H", "T"], ["H", "T"], configs)
    t.fn = chunk_fwd_kernel_o
    x = torch.zeros(2, dtype=torch.bfloat16)
    assert t.run(x, 7, 100).kwargs["BK"] == 64 and t.timed == []
    assert tuning.load_presets(str(tmp_path / "absent.json")) == 0       # unreadable: none added


def test_similar_keys_differ_only_in_named_sizes():
    names = ["B", "H", "BT", "IS_VARLEN"]
    assert similar((8, 16, 64, False, "torch.bfloat16"), (3, 16, 64, False, "torch.bfloat16"), names)
    assert not similar((8, 16, 64, False), (8, 32, 64, False), names)             # heads
    assert not similar((8, 16, 64, False), (8, 16, 32, False), names)             # chunk size
    assert not similar((8, 16, 64, False), (8, 16, 64, True), names)              # a flag
    assert not similar((8, 16, 64, False, "torch.bfloat16"), (3, 16, 64, False, "torch.float32"), names)
    assert not similar((8, 16), (3, 16), None)                                    # no names: no sizes
    assert not similar((8, 16), (8, 16), names)                                   # the same key


def test_batch_shapes_are_the_batches_shapes_main_one_first():
    rng = random.Random(1)
    lengths = [rng.randint(1, 3000) for _ in range(500)]
    shapes = batch_shapes(lengths, 4096, 16)

    class Row:
        def __init__(self, i, n):
            self.index, self.length = i, n
    batches = make_batches([Row(i, n) for i, n in enumerate(lengths)], 4096, 16)
    made = {(len(b), padded_length(max(r.length for r in b), 16)) for b in batches}
    assert set(shapes) == made and len(shapes) == len(made)
    tokens = {s: sum(len(b) * s[1] for b in batches if (len(b), padded_length(max(r.length for r in b), 16)) == s)
              for s in made}
    assert tokens[shapes[0]] == max(tokens.values())
    assert batch_shapes([], 4096, 16) == []


def test_the_tuning_block_is_the_models_own_layer_and_leaves_the_global_rng(models):
    from transformers import AutoConfig

    from worker.model import load_model
    config = AutoConfig.from_pretrained(models["qwen3_5_text"])
    model = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    state = torch.random.get_rng_state()
    block = linear_attention_block(config, torch.device("cpu"), torch.float32)
    assert torch.equal(state, torch.random.get_rng_state())
    assert type(block) is type(layer)
    block.load_state_dict(layer.state_dict())
    x = torch.randn(2, 24, config.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(block(hidden_states=x), layer(hidden_states=x), atol=1e-5)
    steps = []
    assert run_block(block, [(2, 16), (1, 32)], torch.device("cpu"), steps.append) >= 0
    assert steps == [0, 1]


def test_the_tuner_thread_plans_from_the_rows_and_reports_each_shape(models):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(models["qwen3_5_text"])
    seen = []
    tuner = Tuner(config, torch.device("cpu"), torch.float32, lambda: [40, 33, 90, 12, 7] * 4, 256, 16, False,
                  lambda i, n: seen.append((i, n))).start().join()
    assert tuner.error is None and tuner.ran
    assert tuner.shapes == batch_shapes([40, 33, 90, 12, 7] * 4, 256, 16)
    assert seen == [(i, len(tuner.shapes)) for i in range(len(tuner.shapes))]

    failing = Tuner(config, torch.device("cpu"), torch.float32, lambda: 1 / 0, 256, 16, False).start().join()
    assert isinstance(failing.error, ZeroDivisionError) and not failing.ran


def test_the_linear_attention_stands_aside_while_fla_tunes_and_comes_back(models):
    """worker.tuning.linear_attention_aside: the model runs with its Gated DeltaNet blocks
    returning zeros (the rest of each layer compiles meanwhile); after it the model computes
    exactly what it did before."""
    from worker.model import load_model
    from worker.tuning import linear_attention_aside
    model = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    ids = torch.randint(0, 400, (2, 20))
    with torch.inference_mode():
        before = model(input_ids=ids, use_cache=False).last_hidden_state
        with linear_attention_aside(model) as n:
            assert n == sum(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules()) > 0
            block = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
            assert not block(hidden_states=torch.ones(1, 3, 64)).any()
            aside = model(input_ids=ids, use_cache=False).last_hidden_state
        after = model(input_ids=ids, use_cache=False).last_hidden_state
    assert not torch.equal(aside, before)
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_tuning_report_names_the_slowest_kernels():
    from worker import tuning
    saved = tuning.STATS.copy(), tuning.SECONDS.copy()
    try:
        tuning.STATS.clear()
        tuning.SECONDS.clear()
        tuning.STATS.update(tuned=3, reused=5)
        tuning.SECONDS.update({"l2norm_fwd_kernel": 12.0, "chunk_fwd_kernel_o": 3.0})
        assert tuning.tuning_report() == ("3 tuned or read from the host's cache in 15 s: l2norm_fwd 12 s, "
                                          "chunk_fwd_kernel_o 3 s; 5 sizes reused")
    finally:
        tuning.STATS.clear()
        tuning.SECONDS.clear()
        tuning.STATS.update(saved[0])
        tuning.SECONDS.update(saved[1])


def test_fewer_candidates_for_the_kernels_named_and_all_on_request(monkeypatch):
    from worker.tuning import FEWER, fewer

    import types

    class Cfg:
        def __init__(self, nw, bt):
            self.num_warps, self.kwargs = nw, {"BT": bt}
    tuner = FakeAutotuner([], [], [])
    tuner.base_fn = types.SimpleNamespace(__name__="l2norm_fwd_kernel")
    configs = [Cfg(nw, bt) for nw in (1, 2, 4, 8, 16, 32) for bt in (8, 16, 32, 64, 128)]
    kept = fewer(tuner, configs)
    assert kept == [c for c in configs if FEWER["l2norm_fwd_kernel"](c)] and 0 < len(kept) < len(configs)
    assert fewer(tuner, [Cfg(32, 128)])[0].num_warps == 32              # none would stay: all kept
    monkeypatch.setenv("FLEET_FULL_TUNING", "1")
    assert fewer(tuner, configs) == configs
    monkeypatch.delenv("FLEET_FULL_TUNING")
    tuner.base_fn = types.SimpleNamespace(__name__="chunk_fwd_kernel_o")
    assert fewer(tuner, configs) == configs                             # not named: all kept
