"""Captured tensors against transformers' own output_hidden_states, on both architectures."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.identity import ModelShape, model_shape
from worker.layers import LayerError, resolve_layers
from worker.model import Capture, ModelError, find_decoder, load_model, missing_fast_kernels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_presets_follow_the_conventions():
    assert resolve_layers("speculators", 64).ids == resolve_layers("2,32,61,64", 64).ids
    assert resolve_layers("speculators", 64).last_layer_norm == "pre"
    eagle = resolve_layers("eagle3", 64)
    assert eagle.ids == (2, 32, 61, 64) and eagle.last_layer_norm == "post"
    assert resolve_layers("0,3", 8, "post").last_layer_norm == "none"          # L not asked for
    assert resolve_layers("3,8", 8, "post").last_layer_norm == "post"


@pytest.mark.parametrize("spec, message", [("2,99", "out of range"), ("2,2", "repeats"),
                                           ("two", "comma list"), ("", "empty")])
def test_bad_layer_specs_say_why(spec, message):
    with pytest.raises(LayerError, match=message):
        resolve_layers(spec, 8)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_capture_equals_output_hidden_states(models, arch, norm):
    model = load_model(models[arch], "cpu", torch.float32)
    plan = resolve_layers("0,1,4,7,8", model.config.num_hidden_layers, norm)
    decoder = find_decoder(model)
    capture = Capture(decoder, plan)
    torch.manual_seed(1)
    lengths = [13, 7, 10]
    rows = [torch.randint(0, model.config.vocab_size, (n,)) for n in lengths]
    batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for r, ids in enumerate(rows):
        batch[r, : len(ids)] = ids
    with torch.inference_mode():
        model(input_ids=batch, use_cache=False)               # right padding, no attention mask
        got = capture.take()
        assert got.dtype == torch.bfloat16 and got.shape[2] == len(plan.ids)
        for r, ids in enumerate(rows):
            ref = model(input_ids=ids[None], output_hidden_states=True).hidden_states
            assert len(ref) == plan.num_layers + 1
            for slot, k in enumerate(plan.ids):
                mine = got[r, : len(ids), slot]
                if k == plan.num_layers and norm == "pre":
                    # transformers' hs[L] is final-normed; the pre-norm state normed must equal it
                    normed = decoder.norm(mine.float())
                    assert rel_err(normed, ref[k][0]) < 2e-2
                    assert rel_err(mine, ref[k][0]) > 5e-2      # and it really is the raw state
                else:
                    assert rel_err(mine, ref[k][0]) < 1e-2, (arch, k)
    capture.remove()


def test_unknown_architecture_names_what_was_looked_for():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ModelError, match=r"cannot find the decoder layers of Odd.*model\.layers"):
        find_decoder(Odd())


def test_fast_kernel_check_only_for_hybrids(models):
    dense = load_model(models["qwen3"], "cpu", torch.float32)
    hybrid = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    assert missing_fast_kernels(dense) is None
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        assert "flash-linear-attention" in missing_fast_kernels(hybrid)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="model folder not found"):
        load_model(str(tmp_path / "nope"), "cpu", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path / "empty"), "cpu", torch.float32)


def torch_norm_kernels(scale: float = 1.0):
    """fla's two RMS norm kernels as fla computes them (all in fp32, one cast at the end), written
    in torch so the swap runs on the CPU; `scale` != 1 makes a kernel that disagrees."""
    import torch.nn.functional as F

    def plain(x, weight, bias, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight * scale).to(x.dtype)

    def gated(x, g, weight, bias, activation="swish", eps=1e-6):
        return (plain(x, weight, bias, eps).float() * F.silu(g.float())).to(x.dtype)
    return plain, gated


def norm_modules(model) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for m in model.modules():
        if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
            kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    return kinds


def test_fused_norms_are_swapped_in_only_where_they_agree_with_the_models_own(models):
    """worker.model.use_fla_norms on the hybrid: Qwen3.5's decoder norms scale by 1 + w, its gated
    norms by w; the probe finds each convention, and the model's hidden states are unchanged. A
    kernel that disagrees is never swapped in; narrow plain norms are left alone by default."""
    from worker.model import use_fla_norms
    torch.manual_seed(0)
    hybrid = load_model(models["qwen3_5_text"], "cpu", torch.float32)
    for m in hybrid.modules():                        # weights that tell w from 1 + w apart
        if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
            m.weight.data.normal_(0.3, 0.2)
    kinds = norm_modules(hybrid)
    assert kinds["Qwen3_5RMSNorm"] > 0 and kinds["Qwen3_5RMSNormGated"] > 0, kinds
    ids = torch.randint(0, 500, (2, 33))
    with torch.inference_mode():
        want = hybrid(input_ids=ids, output_hidden_states=True).hidden_states
    assert use_fla_norms(hybrid, kernels=torch_norm_kernels(1.5), min_width=1) == 0
    assert use_fla_norms(hybrid, kernels=torch_norm_kernels()) == kinds["Qwen3_5RMSNormGated"]  # hidden 64 < 513
    assert use_fla_norms(hybrid, kernels=torch_norm_kernels(), min_width=1) == kinds["Qwen3_5RMSNorm"]
    assert use_fla_norms(hybrid, kernels=torch_norm_kernels(), min_width=1) == 0      # once only
    with torch.inference_mode():
        got = hybrid(input_ids=ids, output_hidden_states=True).hidden_states
    assert max(rel_err(g, w) for g, w in zip(got, want)) < 1e-5
    final = find_decoder(hybrid).norm
    assert "forward" in final.__dict__                # swapped, and scaling by 1 + w:
    x = torch.randn(3, final.weight.numel())
    with torch.inference_mode():
        assert rel_err(final(x), torch_norm_kernels()[0](x, final.weight + 1, None, final.eps)) < 1e-6


def test_preflight_names_the_fix_for_a_hybrid_without_fla(models):
    """On a GPU host, preflight warns for a hybrid model when flash-linear-attention is absent
    (as here), with the pip command and what it costs; never for a dense model."""
    import importlib.util

    from worker.preflight import hybrid_kernels
    assert importlib.util.find_spec("fla") is None       # the CI/dev install has no fla
    warning = hybrid_kernels(models["qwen3_5_text"])
    assert warning and warning.startswith("qwen3_5_text is a Gated DeltaNet hybrid")
    assert "pip install 'flash-linear-attention>=0.4'" in warning and "tokens/s" in warning
    assert hybrid_kernels(models["qwen3"]) is None


def test_loading_says_how_far_the_reading_of_the_weights_has_got(models, tmp_path):
    """Through the real worker on a real checkpoint (not --random-weights): LOADING's detail counts
    the bytes read against the weight files' size on disk, and the model loaded is the checkpoint's."""
    import os

    from tests.conftest import read_events, run_worker
    from worker.demo import make_token_dataset
    from worker.text import bytes_text

    model = models["qwen3"]
    size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model) if n.endswith(".safetensors"))
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 4, vocab_size=500, mean_tokens=20)
    state = str(tmp_path / "state")
    r = run_worker("--model", model, "--data", data, "--out", str(tmp_path / "out"), "--state", state,
                   "--device", "cpu", "--progress-interval", "0.001")
    assert r.returncode == 0, r.stderr[-2000:]
    reading = [e["detail"] for e in read_events(state) if e["event"] == "loading" and e.get("detail")
               and e["detail"].startswith("reading the weights: ")]
    assert reading and all(f" of {bytes_text(size)} (" in d and d.endswith("/s)") for d in reading), reading
    ours = load_model(model, "cpu", torch.float32)
    from safetensors.torch import load_file
    saved = {k: v for n in os.listdir(model) if n.endswith(".safetensors") for k, v in
             load_file(os.path.join(model, n)).items()}
    name, weight = next((k, v) for k, v in saved.items() if k.endswith("layers.0.mlp.up_proj.weight"))
    assert torch.equal(dict(ours.named_parameters())[name.removeprefix("model.")].float(), weight.float())


# (model_type, its architecture): causal LMs, GPT-2's own names, and a multimodal class that
# builds a default text model where the file leaves its text_config out
SHAPE_CASES = [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
               ("mixtral", "MixtralForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"),
               ("qwen3_5_text", "Qwen3_5ForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
               ("qwen3_5", "Qwen3_5ForConditionalGeneration")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(SHAPE_CASES), sizes=st.tuples(st.integers(1, 64), st.integers(1, 96), st.integers(64, 9000)),
       declared=st.one_of(st.just((True, True, True)), st.tuples(st.booleans(), st.booleans(), st.booleans())),
       gpt2_names=st.booleans(),
       nested=st.booleans(), named=st.booleans(), quantized=st.booleans())
def test_a_models_shape_read_from_its_file_is_the_one_transformers_gives(tmp_path_factory, case, sizes, declared,
                                                                          gpt2_names, nested, named, quantized):
    """model_shape reads config.json itself where the file declares the shape (no transformers,
    no torch: preflight's 2 s); whichever way it reads, the answer is transformers' own config's."""
    from transformers import AutoConfig
    model_type, architecture = case
    names = ("n_embd", "n_layer", "n_positions") if model_type == "gpt2" and gpt2_names else \
        ("hidden_size", "num_hidden_layers", "max_position_embeddings")
    hidden, layers, positions = sizes[0] * 64, sizes[1], sizes[2]
    text = {name: value for name, value, on in zip(names, (hidden, layers, positions), declared) if on}
    config: dict = {"model_type": model_type}
    if nested and model_type == "qwen3_5":
        config["text_config"] = {"model_type": "qwen3_5_text", **text}
    else:
        config.update(text)
    if named:
        config["architectures"] = [architecture]
    if quantized:
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    folder = tmp_path_factory.mktemp("shape")
    (folder / "config.json").write_text(json.dumps(config))
    theirs = AutoConfig.from_pretrained(str(folder)).get_text_config()
    expected = ModelShape(theirs.hidden_size, theirs.num_hidden_layers, getattr(theirs, "max_position_embeddings", None))
    assert model_shape(str(folder)) == expected, config
