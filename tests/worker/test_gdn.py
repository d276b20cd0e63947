"""worker.gdn: a Gated DeltaNet layer with q, k and v projected and convolved apart computes what the
layer's own forward computes (transformers' code, run beside it), in the whole model and over
random shapes and padding masks; the reference checks set it aside; a layer whose own forward
disagrees keeps its own."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import gdn


@pytest.fixture(scope="module")
def hybrid(models):
    from worker.model import load_model
    return load_model(models["qwen3_5_text"], "cpu", torch.float32)


def all_states(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states


def test_the_model_with_split_projections_computes_its_own_hidden_states(models, monkeypatch):
    from worker.model import load_model
    from worker.reference import eager
    model = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    layers = gdn.linear_attention_layers(model)
    assert len(layers) == 6 and layers[0].num_v_heads != layers[0].num_k_heads      # grouped heads
    ids = torch.randint(0, model.config.vocab_size, (3, 45), generator=torch.Generator().manual_seed(1))
    before = all_states(model, ids)

    said = gdn.split_projections(model)
    assert said == ", q/k/v projected apart in 6 linear-attention layers (no copies for fla)"
    assert all("forward" in m.__dict__ for m in layers)
    assert gdn.split_projections(model) == ""           # once only
    after = all_states(model, ids)
    for a, b in zip(before, after):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    cls = type(layers[0])
    own = cls.forward
    with monkeypatch.context() as m:            # the model's own forwards reach the split layers
        m.setattr(cls, "forward", lambda *a, **k: pytest.fail("the layer's own forward ran"))
        torch.testing.assert_close(all_states(model, ids)[-1], after[-1])
    assert cls.forward is own

    with eager(model):                          # the reference checks run transformers' own code
        assert not any("forward" in m.__dict__ for m in layers)
        torch.testing.assert_close(all_states(model, ids)[-1], before[-1], rtol=1e-5, atol=1e-5)
    assert all("forward" in m.__dict__ for m in layers)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3), width=st.integers(1, 70), seed=st.integers(0, 2**16), masked=st.booleans())
def test_split_forward_equals_the_layers_own_on_any_shape_and_mask(hybrid, rows, width, seed, masked):
    layer = gdn.linear_attention_layers(hybrid)[0]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, layer.in_proj_qkv.in_features, generator=g)
    mask = None
    if masked:                                  # each row's padding after its tokens
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
    split = gdn.split_forward(layer, *gdn.kernels(layer))
    with torch.inference_mode():
        own = type(layer).forward(layer, x, attention_mask=mask)
        ours = split(x, attention_mask=mask)
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-5)


def test_a_forward_it_does_not_know_runs_the_layers_own(hybrid, monkeypatch):
    layer = gdn.linear_attention_layers(hybrid)[0]
    cls = type(layer)
    seen = []
    own = cls.forward

    def recording(self, *args, **kwargs):
        seen.append(sorted(k for k, v in kwargs.items() if v is not None))
        return own(self, *args, **{k: v for k, v in kwargs.items() if k != "seq_idx"})
    monkeypatch.setattr(cls, "forward", recording)
    split = gdn.split_forward(layer, *gdn.kernels(layer))
    x = torch.randn(1, 8, layer.in_proj_qkv.in_features)
    with torch.inference_mode():
        split(x)
        split(x, seq_idx=torch.zeros(1, 8, dtype=torch.int32))
    assert seen == [["seq_idx"]]


def test_a_layer_whose_own_forward_disagrees_keeps_it(models, monkeypatch):
    """A transformers whose layer computes something else than split_forward (here: its own
    forward doubled) is found at load, and no layer is split."""
    from worker.model import load_model
    model = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    cls = type(gdn.linear_attention_layers(model)[0])
    own = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: 2 * own(self, *a, **k))
    said = gdn.split_projections(model)
    assert said.startswith(", q/k/v projected together (projected apart they differ by ")
    assert gdn.disagreement(gdn.linear_attention_layers(model)[0]) == pytest.approx(0.5, rel=1e-3)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_layer_without_the_parts_is_left_alone(hybrid):
    layer = gdn.linear_attention_layers(hybrid)[0]
    stripped = torch.nn.Module()
    stripped.conv1d = layer.conv1d
    assert not gdn.splittable(stripped) and gdn.splittable(layer)
    assert gdn.use_split_projections([stripped]) == 0
    assert gdn.disagreement(stripped) is None


def test_the_tuners_block_runs_split_so_fla_tunes_what_the_model_will_run(models, monkeypatch):
    """worker.tuning.Tuner puts split_forward on its block before running it at the shard's shapes."""
    from transformers import AutoConfig

    from worker.tuning import Tuner
    split, ran = [], []
    real = gdn.use_split_projections

    def recording(layers):
        took = real(layers)
        assert took == len(layers) == 1 and "forward" in layers[0].__dict__
        split.extend(layers)
        for layer in layers:                       # what the block then runs
            forward = layer.forward
            layer.forward = lambda *a, _f=forward, **k: ran.append(1) or _f(*a, **k)
        return took
    monkeypatch.setattr(gdn, "use_split_projections", recording)
    config = AutoConfig.from_pretrained(models["qwen3_5_text"])
    tuner = Tuner(config, torch.device("cpu"), torch.float32, lambda: [40, 33, 12], 256, 16, False).start().join()
    assert tuner.error is None and tuner.ran
    assert len(split) == 1 and split[0].forward.__name__ == "<lambda>"
    assert len(ran) == len(tuner.shapes) > 0
