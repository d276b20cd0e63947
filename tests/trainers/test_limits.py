"""Trainer limits judged at extraction: the loss mask and SpecForge DFlash's two-consecutive-
supervised-tokens rule inside the window the trainer reads (SpecForge's data.max_length, 2048 by
default, or [run] max_length); a row that supervises nothing there is recorded as skipped with
the reason, not written for the trainer to crash on (DFlash) or learn nothing from (EAGLE-3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from worker.formats import supervision_problem
from worker.writer import load_finished
from tests.conftest import run_worker

LATE, LONE, FINE = 0, 1, 2


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    late = [0] * 2060 + [1] * 40                      # the answer starts past token 2048
    lone = [0, 1] * 20                                # supervised tokens, never two in a row
    fine = [0] * 10 + [1] * 20
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [(7 * i) % 400 + 3 for i in range(len(m))],
                                        "loss_mask": m}) + "\n" for m in (late, lone, fine)))
    return str(path)


def skipped(out: str) -> dict[int, str]:
    return {i: r["skipped"] for i, r in load_finished(out).items() if "skipped" in r}


@pytest.mark.parametrize("fmt", ["specforge-dflash", "specforge-eagle3"])
def test_rows_without_supervision_inside_specforges_window_are_skipped(dense_model, rows, tmp_path, fmt):
    out = str(tmp_path / "out")
    r = run_worker("--model", dense_model, "--data", rows, "--out", out, "--format", fmt,
                   "--max-skip-fraction", "1", "--max-tokens-per-batch", "4096")
    assert r.returncode == 0, r.stderr
    why = skipped(out)
    assert "within the first 2048 tokens (SpecForge's data.max_length" in why[LATE]
    if fmt == "specforge-dflash":
        assert why[LONE].startswith("no two consecutive supervised tokens")
        assert sorted(why) == [LATE, LONE]
    else:
        assert sorted(why) == [LATE]
    # [run] max_length = 4096 (the trainer's data.max_length raised): the late answer is inside it
    out2 = str(tmp_path / "out2")
    r = run_worker("--model", dense_model, "--data", rows, "--out", out2, "--format", fmt,
                   "--max-skip-fraction", "1", "--max-tokens-per-batch", "4096", "--max-length", "4096")
    assert r.returncode == 0, r.stderr
    assert LATE not in skipped(out2)


def test_window_rule_itself():
    late = np.array([0] * 3000 + [1, 1], dtype=np.uint8)
    assert "2048" in supervision_problem("specforge-eagle3", late)
    assert supervision_problem("specforge-eagle3", late, max_length=4096) is None
    assert "8192" not in (supervision_problem("speculators", late) or "")       # speculators reads 8192
    assert supervision_problem("specforge-dflash", np.array([1, 0, 1], dtype=np.uint8)).startswith(
        "no two consecutive")


def write_yaml(tmp_path, text: str) -> str:
    (tmp_path / "draft.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "num_hidden_layers": 3,
                                                     "num_target_layers": 8,
                                                     "dflash_config": {"target_layer_ids": [1, 3, 5]}}))
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_from_a_specforge_run_yaml_reads_what_specforge_will(tmp_path):
    from worker.layers import LayerError, resolve_layers, yaml_max_length
    ok = write_yaml(tmp_path, "model:\n  draft_model_config: draft.json\n  draft_num_hidden_layers: 3\n"
                              "training:\n  strategy: dflash\ndata:\n  max_length: 4096\n")
    plan = resolve_layers(f"from:{ok}", 8)          # build_target_layer_ids(8, 3) == the config's ids
    assert plan.ids == (2, 4, 6) and yaml_max_length(f"from:{ok}") == 4096
    generated = write_yaml(tmp_path, "model:\n  draft_num_hidden_layers: 2\ntraining:\n  strategy: dflash\n")
    assert resolve_layers(f"from:{generated}", 8).ids == (2, 6) and yaml_max_length(f"from:{generated}") == 2048
    eagle = write_yaml(tmp_path, "model:\n  aux_hidden_state_layer_ids: [1, 3, 4]\n")
    plan = resolve_layers(f"from:{eagle}", 8)
    assert plan.ids == (2, 4, 5, 8) and plan.last_layer_norm == "post"
    override = write_yaml(tmp_path, "model:\n  draft_model_config: draft.json\n  draft_num_hidden_layers: 2\n"
                                    "training:\n  strategy: dflash\n")
    with pytest.raises(LayerError, match=r"draft_num_hidden_layers = 2 makes SpecForge replace the "
                                         r"target_layer_ids \[1, 3, 5\] of draft.json with "
                                         r"build_target_layer_ids\(8, 2\) = \[1, 5\]"):
        resolve_layers(f"from:{override}", 8)


def test_worker_refuses_a_yaml_that_overrides_its_draft_config_and_judges_in_its_window(dense_model, rows, tmp_path):
    override = write_yaml(tmp_path, "model:\n  draft_model_config: draft.json\n  draft_num_hidden_layers: 2\n"
                                    "training:\n  strategy: dflash\n")
    r = run_worker("--model", dense_model, "--data", rows, "--out", str(tmp_path / "o"), "--format",
                   "specforge-dflash", "--layers", f"from:{override}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "model.draft_num_hidden_layers = 2 makes SpecForge replace" in r.stderr
    wide = write_yaml(tmp_path, "model:\n  draft_model_config: draft.json\ntraining:\n  strategy: dflash\n"
                                "data:\n  max_length: 4096\n")
    out = str(tmp_path / "wide")
    r = run_worker("--model", dense_model, "--data", rows, "--out", out, "--format", "specforge-dflash",
                   "--layers", f"from:{wide}", "--max-skip-fraction", "1", "--max-tokens-per-batch", "4096")
    assert r.returncode == 0, r.stderr
    assert sorted(skipped(out)) == [LONE]            # the late answer is inside data.max_length 4096
    assert json.load(open(f"{out}/meta.json"))["max_length"] == 4096


def test_worker_refuses_a_post_norm_last_layer_in_the_speculators_layout(dense_model, rows, tmp_path):
    """speculators' trainer applies the final norm to the last slot itself: hs[L] post-norm (the
    layers SpecForge EAGLE-3 reads) would be normed twice."""
    r = run_worker("--model", dense_model, "--data", rows, "--out", str(tmp_path / "o"),
                   "--format", "speculators", "--layers", "specforge-eagle3")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "hs[8] post-norm would be normed twice" in r.stderr
