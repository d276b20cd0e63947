"""Layers named by what reads them: each preset equals what the trainer's own code picks, draft
configs are read with that trainer's offset, and preflight counts layers through the same resolver."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from worker.formats import trainer_setting
from worker.layers import LayerError, build_target_layer_ids, preset_ids, resolve_layers

SIZES = (8, 28, 36, 48, 64, 94)


@pytest.mark.parametrize("L", SIZES)
def test_presets_as_hs_indices(L):
    spec = [2, L // 2, L - 3]
    for name in ("speculators", "speculators-eagle3", "speculators-dflash"):
        plan = resolve_layers(name, L)
        assert plan.ids == tuple(spec + [L]) and plan.last_layer_norm == "pre"
    for name in ("specforge-eagle3", "eagle3", "eagle3-official"):
        plan = resolve_layers(name, L)
        assert plan.ids == tuple(spec + [L]) and plan.last_layer_norm == "post"
    assert resolve_layers("eagle", L).ids == (L,) and resolve_layers("eagle", L).last_layer_norm == "post"
    assert resolve_layers("specforge-dflash", L).ids == (L // 2 + 1,)
    assert resolve_layers("specforge-dflash:5", L).last_layer_norm == "none"


def test_specforge_dflash_five_layers_on_a_64_layer_target():
    # build_target_layer_ids(64, 5) = [1, 16, 31, 46, 61]; SpecForge reads hidden_states[id + 1]
    plan = resolve_layers("specforge-dflash:5", 64)
    assert plan.ids == (2, 17, 32, 47, 62)
    assert trainer_setting("specforge-dflash", plan) == "dflash_config.target_layer_ids = [1, 16, 31, 46, 61]"


@pytest.mark.parametrize("L", SIZES)
def test_speculators_default_equals_its_own_resolver(L, tmp_path):
    utils = pytest.importorskip("speculators.models.utils")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "num_hidden_layers": L, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "intermediate_size": 128}))
    with pytest.warns(UserWarning):                    # it warns that it picked its default
        theirs = utils.resolve_target_layer_ids(None, str(tmp_path))
    ids, norm = preset_ids("speculators", L)
    assert ids == theirs + [L] and norm == "pre"       # its ids are hs indices; hs[L] appended
    plan = resolve_layers("speculators", L)
    assert trainer_setting("speculators", plan) == "--target-layer-ids " + " ".join(map(str, theirs))


@pytest.mark.parametrize("L", SIZES)
def test_specforge_eagle3_default_equals_its_own_resolver(L):
    providers = pytest.importorskip("specforge.algorithms.model_providers")
    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    theirs = providers.resolve_eagle_capture_layers(cfg, {}, SimpleNamespace(num_hidden_layers=L))
    ids, norm = preset_ids("specforge-eagle3", L)
    assert ids == [k + 1 for k in theirs] + [L] and norm == "post"    # SGLang captures id + 1
    plan = resolve_layers("specforge-eagle3", L)
    assert trainer_setting("specforge-eagle3", plan) == f"model.aux_hidden_state_layer_ids = {theirs}"


@pytest.mark.parametrize("L", SIZES)
@pytest.mark.parametrize("draft_layers", [1, 2, 3, 5, 8])
def test_specforge_dflash_equals_its_own_functions(L, draft_layers):
    dflash = pytest.importorskip("specforge.modeling.draft.dflash")
    import torch
    theirs = dflash.build_target_layer_ids(L, draft_layers)
    assert build_target_layer_ids(L, draft_layers) == theirs
    # extract_context_feature reads hidden_states[id + 1]: feed it hs indices as values
    hs = [torch.full((1, 1), float(k)) for k in range(L + 1)]
    picked = dflash.extract_context_feature(hs, theirs)[0].tolist()
    ids, _ = preset_ids(f"specforge-dflash:{draft_layers}", L)
    assert [int(x) for x in picked] == ids
    plan = resolve_layers(f"specforge-dflash:{draft_layers}", L)
    if len(set(ids)) == len(ids):            # tiny targets: repeated ids are merged
        assert trainer_setting("specforge-dflash", plan) == f"dflash_config.target_layer_ids = {theirs}"


def write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return f"from:{path}"


def test_from_draft_configs_apply_each_trainers_offset(tmp_path):
    L = 64
    # speculators' own config: ids are hs indices, hs[L] pre-norm appended
    p = resolve_layers(write(tmp_path, {"speculators_model_type": "eagle3",
                                        "eagle_aux_hidden_state_layer_ids": [1, 23, 44]}), L)
    assert p.ids == (1, 23, 44, 64) and p.last_layer_norm == "pre"
    assert trainer_setting("speculators", p) == "--target-layer-ids 1 23 44"
    p = resolve_layers(write(tmp_path, {"speculators_model_type": "dflash",
                                        "aux_hidden_state_layer_ids": [2, 10, 18]}), L)
    assert p.ids == (2, 10, 18, 64)
    # SpecForge / z-lab DFlash: hidden_states[id + 1], no final state
    p = resolve_layers(write(tmp_path, {"architectures": ["DFlashDraftModel"],
                                        "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]}}), L)
    assert p.ids == (2, 17, 32, 47, 62) and p.last_layer_norm == "none" and not p.target_last
    assert trainer_setting("specforge-dflash", p) == "dflash_config.target_layer_ids = [1, 16, 31, 46, 61]"
    # a DFlash config without ids: what its DFlashDraftModel builds
    p = resolve_layers(write(tmp_path, {"architectures": ["DFlashDraftModel"], "num_target_layers": 64,
                                        "num_hidden_layers": 5, "dflash_config": {}}), L)
    assert p.ids == (2, 17, 32, 47, 62)
    # DSpark: the Qwen3.6-27B config's ids, plus target_last_hidden_states (hs[L] post-norm)
    p = resolve_layers(write(tmp_path, {"architectures": ["DSparkDraftModel"],
                                        "dflash_config": {"target_layer_ids": [2, 17, 32, 47, 62]}}), L)
    assert p.ids == (3, 18, 33, 48, 63, 64) and p.target_last and p.last_layer_norm == "post"
    assert trainer_setting("specforge-dflash", p) == "dflash_config.target_layer_ids = [2, 17, 32, 47, 62]"
    # SpecForge EAGLE-3 draft config: SGLang adds 1; its target is hs[L] post-norm
    p = resolve_layers(write(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"],
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 31, 60]}}), L)
    assert p.ids == (2, 32, 61, 64) and p.last_layer_norm == "post"
    assert trainer_setting("specforge-eagle3", p) == "model.aux_hidden_state_layer_ids = [1, 31, 60]"
    p = resolve_layers(write(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"]}), L)
    assert p.ids == (2, 32, 61, 64)                    # no ids: SpecForge's default


@pytest.mark.parametrize("cfg, message", [
    ({"architectures": ["LlamaForCausalLM"]}, "no target layer ids found"),
    ({"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": "1,2"}}, "list of integers"),
    ({"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [1, 99]}}, "out of range"),
])
def test_bad_draft_configs_say_why(tmp_path, cfg, message):
    with pytest.raises(LayerError, match=message):
        resolve_layers(write(tmp_path, cfg), 64)
    with pytest.raises(LayerError, match="no such file"):
        resolve_layers(f"from:{tmp_path}/nope.json", 64)


def test_ambiguous_dflash_is_refused_with_the_choices():
    with pytest.raises(LayerError) as e:
        resolve_layers("dflash", 64)
    assert "ambiguous" in str(e.value) and "speculators-dflash" in str(e.value) \
        and "specforge-dflash" in str(e.value) and "\n" not in str(e.value)


def test_target_last_adds_the_final_state():
    p = resolve_layers("specforge-dflash:5", 64, target_last=True)
    assert p.ids == (2, 17, 32, 47, 62, 64) and p.last_layer_norm == "post" and p.target_last
    with pytest.raises(LayerError, match="already among these layers"):
        resolve_layers("speculators", 64, target_last=True)


@pytest.mark.parametrize("layers, fmt, count", [("speculators", "speculators", 4), ("eagle", "eagle", 1),
                                                ("specforge-dflash:5", "specforge-dflash", 5), (None, "eagle", 1)])
def test_preflight_counts_layers_with_the_same_resolver(tmp_path, layers, fmt, count):
    from worker import preflight
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 100, "num_hidden_layers": 64}))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(10))}) + "\n" for _ in range(50)))
    argv = ["--builtin", "--device", "cpu", "--model", str(model), "--data", str(data),
            "--output", str(tmp_path / "out"), "--format", fmt] + (["--layers", layers] if layers else [])
    report = preflight.run(preflight.parse_args(argv))
    fp = report.footprint
    assert (fp.tokens, fp.layers, fp.exact) == (500, count, True)
    ids_mask = 9 if fmt == "speculators" else 16                 # int64 ids + uint8 / int64 mask
    assert fp.bytes_per_token == count * 100 * 2 + ids_mask
    assert report.estimated_bytes == fp.total_bytes == 500 * fp.bytes_per_token + 50 * fp.bytes_per_file
    assert not report.errors


def test_preflight_refuses_what_the_worker_would(tmp_path):
    import subprocess
    import sys
    from tests.conftest import REPO
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 100, "num_hidden_layers": 64}))
    for layers, fmt, message in (("dflash", "speculators", "ambiguous"),
                                 ("speculators", "specforge-eagle3", "3 aux layers + hs[64] post-norm")):
        r = subprocess.run([sys.executable, "-m", "worker.preflight", "--builtin", "--device", "cpu",
                            "--model", str(model), "--layers", layers, "--format", fmt],
                           cwd=REPO, capture_output=True, text=True)
        errors = [c["message"] for c in json.loads(r.stdout)["checks"] if c["level"] == "error"]
        assert any(message in e for e in errors), errors
