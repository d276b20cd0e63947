"""The exact command that trains on an output folder, from its meta.json: every flag the files need
(layer ids in the trainer's numbering, speculators' fp8 backend, paths, the window the worker judged
the loss mask in). `fleet verify` and the finished-run line print it. Standard library only."""

from __future__ import annotations

import os
import shlex

from .formats import TRAINER_WINDOW, context_slots
from .layers import LayerPlan

q = shlex.quote                       # every path and name in a command is quoted


def _plan(meta: dict) -> LayerPlan:
    ids = tuple(meta.get("layer_ids") or ())
    return LayerPlan(ids, meta.get("last_layer_norm", "none"), meta.get("num_layers", max(ids, default=0)),
                     bool(meta.get("target_last_hidden_states", False)))


def training_command(meta: dict, out: str | None = None) -> str:
    """One shell line (out: the folder as the trainer's host sees it; default meta's data_dir)."""
    fmt = meta.get("format", "speculators")
    model = meta.get("model", "<model>")
    plan = _plan(meta)
    out = out or (os.path.dirname(meta["data_dir"]) if fmt == "eagle" and meta.get("data_dir")
                  else meta.get("data_dir", "<output>"))
    window = meta.get("max_length") or TRAINER_WINDOW.get(fmt)
    if fmt == "speculators":
        return _speculators_command(meta, plan, model, out, window)
    if fmt in ("specforge-eagle3", "specforge-dflash"):
        return _specforge_command(meta, fmt, plan, model, out, window)
    return (f"accelerate launch -m --mixed_precision=bf16 eagle.train.main --basepath {q(model)} "
            f"--tmpdir {q(os.path.join(out, 'data'))} --cpdir ./ckpt --configpath <your draft config.json>"
            f"  # train_config max_len = {window}")



def _speculators_command(meta: dict, plan: LayerPlan, model: str, out: str, window: int | None) -> str:
    """speculators reads its prepared dataset; the layer ids but the last (which it adds itself),
    the fp8 backend for fp8 files, and the window where it is not the trainer's default."""
    algo = "dflash" if "dflash" in str(meta.get("layers", "")) else "eagle3"
    cmd = ["speculators", "train", "--speculator-type", algo, "--verifier-name-or-path", q(model),
           "--data-path", q(os.path.join(out, "prepared")),
           "--target-layer-ids", *map(str, plan.ids[:-1])]
    if meta.get("dtype") == "float8_e4m3fn":
        cmd += ["--hidden-states-backend", "fp8"]
    if window and window != TRAINER_WINDOW["speculators"]:
        cmd += ["--total-seq-len", str(window)]
    return " ".join(cmd)


def _specforge_command(meta: dict, fmt: str, plan: LayerPlan, model: str, out: str, window: int | None) -> str:
    """SpecForge takes a run config (the user's own yaml where the layers came from one, else
    run.yaml) and dotted overrides; the layer ids go where that trainer reads them."""
    ids = [plan.ids[s] - 1 for s in context_slots(fmt, plan)]
    spec = str(meta.get("layers") or "")
    source = spec[len("from:"):] if spec.startswith("from:") else ""
    own_yaml = source.endswith((".yaml", ".yml"))      # the user's run config: it holds the ids
    cmd = ["specforge", "train", "-c", q(source if own_yaml else "run.yaml"),
           f"model.target_model_path={q(model)}", f"data.hidden_states_path={q(out)}",
           f"data.max_length={window}"]
    if source and not own_yaml:
        cmd.append(f"model.draft_model_config={q(source)}")
    if fmt == "specforge-eagle3":
        return _specforge_eagle3(cmd, ids, source, own_yaml)
    return _specforge_dflash(cmd, ids, spec, source, own_yaml, plan.target_last)


def _specforge_eagle3(cmd: list[str], ids: list[int], source: str, own_yaml: bool) -> str:
    """EAGLE-3's strategy, and its aux layer ids where no config of the user's holds them."""
    cmd += [] if own_yaml else ["training.strategy=eagle3"]
    if source:
        return " ".join(cmd)
    # a dotted override cannot set a list the yaml leaves unset
    return " ".join(cmd) + f"  # run.yaml: model.aux_hidden_state_layer_ids: {ids}"


def _specforge_dflash(cmd: list[str], ids: list[int], spec: str, source: str, own_yaml: bool,
                      target_last: bool) -> str:
    """DFlash's (or, with the target's last state, DSpark's) strategy, and its layers: SpecForge's
    own ids by draft layer count, or the ids in a draft config the user writes."""
    if not own_yaml:
        cmd.append(f"training.strategy={'dspark' if target_last else 'dflash'}")
    if spec.startswith("specforge-dflash:") and spec != "specforge-dflash:1":
        cmd.append(f"model.draft_num_hidden_layers={spec.partition(':')[2]}")   # SpecForge's own ids
    elif not source and not spec.startswith("specforge-dflash"):
        return " ".join(cmd) + f"  # draft config: dflash_config.target_layer_ids = {ids}, " \
                               f"no model.draft_num_hidden_layers (it would replace them)"
    return " ".join(cmd)


def trainer_problems(out: str, meta: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) for the trainer of this folder. Problem: layers its reader would misread (a
    folder written before the refusal). Notes (a run still going or killed has them too):
    speculators' prepared dataset missing or stale, a temp file an interrupted write or export left
    (no reader lists it; its sample is not in a manifest)."""
    from . import protocol
    from .formats import FormatError, check_plan
    from .prepared import check_prepared
    if not meta:
        return [], []
    problems, notes = [], []
    fmt = meta.get("format", "speculators")
    try:
        check_plan(fmt, _plan(meta))
    except FormatError as e:
        problems.append(f"meta.json: {e}")
    if fmt == "speculators" and (why := check_prepared(out)):
        notes.append(why)
    for top in {os.path.abspath(out), os.path.abspath(meta.get("data_dir") or out)}:
        for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            if name.startswith(protocol.TEMP_PREFIX):
                notes.append(f"{os.path.join(top, name)}: left by an interrupted write or export "
                             f"(no trainer reads it); remove it")
    return problems, notes
