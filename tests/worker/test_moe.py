"""Mixture-of-experts models as a first-class shape (issue 56), on a tiny random Qwen3-MoE on the
CPU: the FLOP model's active parameters, the experts' batch budget, the grouped experts path
against the block's own forward, and the fallback where the fast kernels cannot run."""

from __future__ import annotations

import pytest
import torch

from worker.kernels import (FAST_ENV, experts_modules, grouped_forward, routed_groups, torch_gemms,
                            use_fast_kernels, use_grouped_experts)
from worker.model import (active_parameters, config_active_parameters, expert_rows, experts_budget,
                          moe_shape)

transformers = pytest.importorskip("transformers")


def tiny_config(**kw):
    shape = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)
    shape.update(kw)
    return transformers.AutoConfig.for_model("qwen3_moe", **shape)


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(tiny_config(), dtype=torch.float32).eval()


def test_active_parameters_count_k_of_e_experts(moe):
    cfg = moe.config
    H, I, E, k, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, 2
    attention = H * 4 * 8 + 2 * H * 2 * 8 + 4 * 8 * H + 2 * 8          # q, k, v, o and the q/k norms
    per_layer_dense = attention + E * H + 2 * H                          # router and the two layer norms
    total, active = active_parameters(moe)
    assert total == L * (per_layer_dense + E * 3 * H * I) + H            # + the final norm
    assert active == L * (per_layer_dense + k * 3 * H * I) + H
    assert config_active_parameters(cfg) == (total, active)


def test_a_dense_model_counts_all_its_parameters():
    cfg = transformers.AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8)
    total, active = config_active_parameters(cfg)
    assert total == active > 0
    assert moe_shape(cfg) is None


def test_the_etas_flop_model_weighs_attention_against_the_active_parameters(moe):
    """worker.sizing's prior (attention's FLOPs per position against a token's other work) agrees
    with the exact active count, within the router and norms it leaves out."""
    from worker.sizing import attention_weight
    cfg = moe.config
    exact = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers / (2 * active_parameters(moe)[1])
    assert attention_weight(cfg) == pytest.approx(exact, rel=0.15)
    big = tiny_config(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      vocab_size=151936)
    exact = 4 * 32 * 128 * 48 / (2 * config_active_parameters(big)[1])
    assert attention_weight(big) == pytest.approx(exact, rel=0.01)       # Qwen3-30B-A3B's shape


def test_an_moes_batches_give_each_expert_its_rows():
    big = tiny_config(num_experts=128, num_experts_per_tok=8)
    assert expert_rows(16384, big) == 1024
    assert experts_budget(16384, big) == 32768                          # 2,048 rows an expert
    assert experts_budget(65536, big) == 65536                          # a larger budget asked stays
    assert experts_budget(16384, big, rows=1 << 20) == 65536            # capped
    dense = transformers.AutoConfig.for_model("qwen3")
    assert experts_budget(16384, dense) == 16384
    assert expert_rows(16384, dense) is None


def routed(moe, tokens: int = 37, seed: int = 1):
    block = moe.layers[0].mlp
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, moe.config.hidden_size, generator=g)
    _, weights, index = block.gate(x)
    return block.experts, x, index, weights


def test_routed_groups_sort_the_pairs_by_expert(moe):
    experts, x, index, _ = routed(moe)
    order, cu, rows = routed_groups(index, experts.num_experts)
    flat = index.reshape(-1)
    assert cu[0] == 0 and cu[-1] == flat.numel()
    assert torch.equal(torch.diff(cu.long()), torch.bincount(flat, minlength=experts.num_experts))
    assert torch.equal(flat[order], torch.sort(flat, stable=True).values)
    assert torch.equal(rows.long(), order // index.shape[1])


def test_the_grouped_path_computes_what_the_experts_own_forward_does(moe):
    experts, x, index, weights = routed(moe)
    with torch.inference_mode():
        want = type(experts).forward(experts, x, index, weights)
        got = grouped_forward(*torch_gemms())(experts, x, index, weights)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_without_the_kernels_todays_path_stays_and_the_note_says_why(moe):
    assert experts_modules(moe)
    note = use_fast_kernels(moe, torch.device("cpu"))
    assert note == "experts: transformers' grouped_mm (fast kernels: no CUDA GPU)"
    assert not any("forward" in m.__dict__ for m in experts_modules(moe))


def test_fleet_fast_0_keeps_todays_path(moe, monkeypatch):
    monkeypatch.setenv(FAST_ENV, "0")
    assert use_fast_kernels(moe, torch.device("cpu"), torch_gemms, "torch") == \
        "experts: transformers' grouped_mm (FLEET_FAST=0)"
    assert not any("forward" in m.__dict__ for m in experts_modules(moe))


def test_a_dense_model_has_no_fast_note():
    cfg = transformers.AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8)
    assert use_fast_kernels(transformers.AutoModel.from_config(cfg), torch.device("cpu")) == ""


def test_swapped_experts_are_set_aside_by_the_reference_checks(monkeypatch):
    """The swap runs the whole model as before, and worker.reference.eager runs transformers' own
    experts for a reference forward, putting the swap back after."""
    from worker.reference import eager
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_config(), dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 11))
    with torch.inference_mode():
        want = model(input_ids=ids).last_hidden_state
    note = use_fast_kernels(model, torch.device("cpu"), torch_gemms, "torch")
    assert note.startswith("experts: torch's grouped GEMMs, SwiGLU epilogue (2 blocks")
    modules = experts_modules(model)
    assert all("forward" in m.__dict__ for m in modules)
    calls = []
    gemms = torch_gemms()
    counted = (lambda *a: calls.append(1) or gemms[0](*a), gemms[1])
    for m in modules:
        m.forward = grouped_forward(*counted).__get__(m)
    with torch.inference_mode():
        got = model(input_ids=ids).last_hidden_state
        assert len(calls) == 2
        with eager(model):
            assert not any("forward" in m.__dict__ for m in modules)
            model(input_ids=ids)
        assert len(calls) == 2
    assert all("forward" in m.__dict__ for m in modules)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_a_swap_that_disagrees_is_not_kept(moe):
    swiglu, plain = torch_gemms()
    wrong = (lambda x, w, cu, rows: 2 * swiglu(x, w, cu, rows), plain)
    swapped, error = use_grouped_experts(moe, wrong, label="wrong")
    assert swapped == 0 and error > 0.5
    assert not any("forward" in m.__dict__ for m in experts_modules(moe))

