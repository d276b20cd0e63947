"""SpecForge's own `train` (offline, EAGLE-3) runs two steps on the worker's output of a raw chat
dataset, from the command `worker.verify` prints: every written sample is loaded by its data
plane with supervised tokens, the loss is finite. GPU-only pieces patched in run_specforge.py."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_worker

pytest.importorskip("specforge.cli")
pytest.importorskip("accelerate")
ROWS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory, dense_model) -> str:
    """The tiny model with the model.safetensors.index.json SpecForge's target-head loader reads."""
    from safetensors import safe_open
    folder = tmp_path_factory.mktemp("target")
    for name in os.listdir(dense_model):
        os.symlink(os.path.join(dense_model, name), folder / name)
    with safe_open(os.path.join(dense_model, "model.safetensors"), "pt") as f:
        weights = {k: "model.safetensors" for k in f.keys()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    return str(folder)


def train_and_check(tmp_path, run_yaml, words: list[str]) -> None:
    """SpecForge's own train, with the flags the printed command carries: every sample loaded, each
    with supervised tokens, two finite losses."""
    r = subprocess.run([sys.executable, "-m", "tests.trainers.run_specforge", "train", "-c", str(run_yaml),
                        *words[4:]], cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    names = sorted(int(os.path.basename(p)[5:-5]) for p in got["loaded"])
    assert names == list(range(ROWS)) and all(n > 0 for n in got["loaded"].values())
    assert len(got["losses"]) == 2 and all(math.isfinite(x) for x in got["losses"])


@pytest.mark.slow
def test_specforge_eagle3_trains_on_every_sample(tmp_path, target):
    from worker.demo import make_chat_dataset
    from worker.verify import verify
    chats = make_chat_dataset(str(tmp_path / "chat.jsonl"), ROWS, mean_words=24)
    out = str(tmp_path / "out")
    r = run_worker("--model", target, "--data", chats, "--out", out, "--format", "specforge-eagle3")
    assert r.returncode == 0, r.stderr
    command, _, yaml_line = verify(out)["command"].partition("  # run.yaml: ")
    words = shlex.split(command)
    assert words[:4] == ["specforge", "train", "-c", "run.yaml"]
    key, _, ids = yaml_line.partition(": ")
    assert key == "model.aux_hidden_state_layer_ids"
    # SpecForge's generated draft has a 32000-token vocabulary; the tiny target has 512
    draft = tmp_path / "draft.json"
    cfg = json.load(open(os.path.join(target, "config.json")))
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                 "num_hidden_layers": 1, "draft_vocab_size": cfg["vocab_size"],
                                 "hidden_act": "silu", "tie_word_embeddings": False,
                                 **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim", "vocab_size",
                                                        "max_position_embeddings", "rms_norm_eps")}}))
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(f"model:\n  target_model_path: {target}\n  draft_model_config: {draft}\n"
                        f"  aux_hidden_state_layer_ids: {ids}\n"
                        f"data:\n  hidden_states_path: {out}\n"
                        f"training:\n  fsdp_sharding: NO_SHARD\n  attention_backend: sdpa\n  ttt_length: 2\n"
                        f"  batch_size: {ROWS}\n  num_epochs: 2\noutput_dir: {tmp_path / 'ckpt'}\n")
    train_and_check(tmp_path, run_yaml, words)


@pytest.mark.slow
@pytest.mark.parametrize("layers, draft_layers", [("specforge-dflash", 1), ("specforge-dflash:3", 3)])
def test_specforge_dflash_trains_on_every_sample(tmp_path, target, layers, draft_layers):
    """Its auto-generated draft (1 layer, or 3 through model.draft_num_hidden_layers, which the
    printed command carries): the target layers SpecForge derives are the ones written."""
    from worker.demo import make_chat_dataset
    from worker.verify import verify
    chats = make_chat_dataset(str(tmp_path / "chat.jsonl"), ROWS, mean_words=24)
    out = str(tmp_path / "out")
    r = run_worker("--model", target, "--data", chats, "--out", out, "--format", "specforge-dflash",
                   "--layers", layers)
    assert r.returncode == 0, r.stderr
    command = verify(out)["command"]
    assert "#" not in command and ("model.draft_num_hidden_layers=3" in command) == (draft_layers == 3)
    words = shlex.split(command)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(f"model:\n  target_model_path: {target}\ndata:\n  hidden_states_path: {out}\n"
                        f"training:\n  fsdp_sharding: NO_SHARD\n  attention_backend: sdpa\n"
                        f"  batch_size: {ROWS}\n  num_epochs: 2\noutput_dir: {tmp_path / 'ckpt'}\n")
    train_and_check(tmp_path, run_yaml, words)
