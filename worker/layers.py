"""Which hidden states a trainer reads, as `output_hidden_states` indices. Standard library only:
preflight resolves layers on hosts without torch.

hs[0] is the embedding output, hs[k] the output of decoder layer k-1, and hs[L] the last layer's
output, raw ("pre" norm) or final-normed ("post"). Trainers number layers differently (SpecForge's
and SGLang's aux id k is hs[k+1]; speculators' ids are hs indices), so every preset and every draft
config is translated here, in one place, into hs indices (worker.formats.trainer_setting writes
down the setting a trainer needs to read the same layers back).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# name -> what it reproduces (the trainer code it was checked against is in preset_ids).
PRESETS = {
    "speculators": "speculators EAGLE-3/DFlash: [2, L//2, L-3] + hs[L] pre-norm",
    "speculators-eagle3": "speculators EAGLE-3: [2, L//2, L-3] + hs[L] pre-norm",
    "speculators-dflash": "speculators DFlash: [2, L//2, L-3] + hs[L] pre-norm",
    "specforge-eagle3": "SpecForge EAGLE-3: aux [1, L//2-1, L-4] (hs [2, L//2, L-3]) + hs[L] post-norm",
    "specforge-dflash": "SpecForge DFlash (auto draft config, 1 layer; specforge-dflash:N for N): "
                        "build_target_layer_ids(L, N), each +1",
    "eagle3": "EAGLE-3 official: [2, L//2, L-3] + hs[L] post-norm",
    "eagle3-official": "EAGLE-3 official: [2, L//2, L-3] + hs[L] post-norm",
    "eagle": "EAGLE-1/2: hs[L] post-norm only",
}
REFUSED = {"dflash": "ambiguous: speculators' DFlash and SpecForge's DFlash read different layers"}
FROM_PREFIX = "from:"


class LayerError(Exception):
    """The layer spec cannot be used (unknown preset, bad ids, unreadable draft config)."""


@dataclass(frozen=True)
class LayerPlan:
    ids: tuple[int, ...]          # hs indices, in file order
    last_layer_norm: str          # "pre" | "post" | "none" (hs[L] not among the ids)
    num_layers: int               # L
    target_last: bool = False     # hs[L] is the trainer's separate final state (DSpark), not context


def choices() -> str:
    return ", ".join(PRESETS) + f", {FROM_PREFIX}<draft config.json or SpecForge run.yaml> or a comma list of hs indices"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's (and DFlash's) default target layer ids, copied from
    specforge/modeling/draft/dflash.py: evenly spaced from 1 to L-3 (one layer: L//2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


def preset_ids(name: str, L: int) -> tuple[list[int], str]:
    """(hs ids, norm of hs[L]) of a preset: the one place each trainer's default layers are
    written down, each checked against that trainer's code."""
    base, _, arg = name.partition(":")
    if base in ("speculators", "speculators-eagle3", "speculators-dflash"):
        # speculators/models/utils.py resolve_target_layer_ids: [2, n//2, n-3] as hs indices; the
        # trainer splits hidden_states[:, -1] off as the verifier state and norms it itself.
        return [2, L // 2, L - 3, L], "pre"
    if base == "specforge-eagle3":
        # specforge/algorithms/model_providers.py resolve_eagle_capture_layers: [1, L//2-1, L-4];
        # SGLang's set_eagle3_layers_to_capture adds 1. `hidden_state` is the final-normed output.
        aux = [1, L // 2 - 1, L - 4]
        return [k + 1 for k in aux] + [L], "post"
    if base == "specforge-dflash":
        # SpecForge's auto-generated DFlash draft has 1 layer (dflash/providers.py target_defaults);
        # its DFlashDraftModel reads hidden_states[layer_id + 1] (extract_context_feature).
        try:
            n = int(arg) if arg else 1
        except ValueError:
            raise LayerError(f"layers {name!r}: expected specforge-dflash:<draft layers>") from None
        if n < 1:
            raise LayerError(f"layers {name!r}: the draft needs at least one layer")
        return [k + 1 for k in build_target_layer_ids(L, n)], "none"
    if base in ("eagle3", "eagle3-official"):
        # EAGLE eagle/traineagle3/modeling_llama_kv.py keeps the input of layers 2, L//2, L-3 (hs
        # indices) and its target is lm_head of the final-normed output: nothing to set.
        return [2, L // 2, L - 3, L], "post"
    if base == "eagle":
        # EAGLE-1/2 ge_data: hidden_states[-1] of output_hidden_states, i.e. final-normed.
        return [L], "post"
    raise KeyError(name)


_DFLASH_STRATEGIES = ("dflash", "domino", "dspark")


def _trainer_yaml(path: str) -> dict:
    try:
        import yaml                      # PyYAML comes with transformers on the GPU hosts
    except ImportError:
        raise LayerError(f"layers from:{path}: reading a YAML run config needs PyYAML") from None
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except FileNotFoundError:
        raise LayerError(f"layers from:{path}: no such file") from None
    except (OSError, yaml.YAMLError) as e:
        raise LayerError(f"layers from:{path}: not a readable YAML run config: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise LayerError(f"layers from:{path}: not a YAML mapping")
    return cfg


def yaml_max_length(spec: str | None) -> int | None:
    """`data.max_length` of a SpecForge run config named by `from:<run.yaml>` (its default 2048
    when unset), else None: the window in which the loss mask is judged."""
    if not spec or not spec.strip().startswith(FROM_PREFIX) or not spec.strip().endswith((".yaml", ".yml")):
        return None
    data = _trainer_yaml(os.path.expanduser(spec.strip()[len(FROM_PREFIX):])).get("data") or {}
    value = data.get("max_length", 2048)
    return value if isinstance(value, int) and value > 0 else 2048


def from_trainer_yaml(path: str, L: int) -> tuple[list[int], str, bool]:
    """(hs ids, norm of hs[L], DSpark) that SpecForge will read, from its run config: the draft
    config it names (model.draft_model_config, relative to the yaml) or its generated defaults,
    with `model.draft_num_hidden_layers`, which makes SpecForge replace a DFlash draft config's
    target_layer_ids by build_target_layer_ids(L, N) (algorithms/model_providers.py
    apply_dflash_overrides): refused when that differs from the ids the draft config declares."""
    cfg = _trainer_yaml(path)
    model = cfg.get("model") or {}
    strategy = str((cfg.get("training") or {}).get("strategy", "eagle3"))
    n = model.get("draft_num_hidden_layers")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise LayerError(f"layers from:{path}: model.draft_num_hidden_layers = {n!r}: expected a positive integer")
    draft = model.get("draft_model_config")
    if strategy not in _DFLASH_STRATEGIES:
        aux = model.get("aux_hidden_state_layer_ids")
        if aux is not None:
            return [k + 1 for k in _int_list(aux, f"model.aux_hidden_state_layer_ids in {path}")] + [L], "post", False
        if draft:
            return from_draft_config(os.path.join(os.path.dirname(path), os.path.expanduser(draft)), L)
        return (*preset_ids("specforge-eagle3", L), False)
    if not draft:
        return [k + 1 for k in build_target_layer_ids(L, n or 1)], "post", strategy == "dspark"
    draft_path = os.path.join(os.path.dirname(path), os.path.expanduser(draft))
    ids, norm, dspark = from_draft_config(draft_path, L)
    if n is not None:
        theirs = [k + 1 for k in build_target_layer_ids(L, n)]
        declared = ids                   # DSpark's hs[L] is added by resolve_layers, not here
        if declared != theirs:
            raise LayerError(
                f"layers from:{path}: model.draft_num_hidden_layers = {n} makes SpecForge replace the "
                f"target_layer_ids {[k - 1 for k in declared]} of {draft} with build_target_layer_ids({L}, "
                f"{n}) = {[k - 1 for k in theirs]}: remove model.draft_num_hidden_layers, or the ids")
    return ids, norm, dspark


def from_draft_config(path: str, L: int) -> tuple[list[int], str, bool]:
    """(hs ids, norm of hs[L], DSpark) from the target layer ids a draft model's config.json
    declares, with the offset of the trainer that wrote that kind of config."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LayerError(f"layers from:{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise LayerError(f"layers from:{path}: not a readable JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise LayerError(f"layers from:{path}: not a JSON object")
    arch = " ".join(map(str, cfg.get("architectures") or []))
    where = f"in {path}"     # for error messages
    if "speculators_model_type" in cfg:
        # speculators' own configs hold hs indices; its trainer appends hs[L] pre-norm.
        key = "eagle_aux_hidden_state_layer_ids" if "eagle_aux_hidden_state_layer_ids" in cfg \
            else "aux_hidden_state_layer_ids"
        ctx = _int_list(cfg.get(key), f"{key} {where}") if cfg.get(key) is not None \
            else [2, L // 2, L - 3]
        return ctx + [L], "pre", False
    dflash = cfg.get("dflash_config")
    if isinstance(dflash, dict) or "DFlash" in arch or "DSpark" in arch or "Domino" in arch:
        dflash = dflash if isinstance(dflash, dict) else {}
        if dflash.get("target_layer_ids") is not None:
            tl = _int_list(dflash["target_layer_ids"], f"dflash_config.target_layer_ids {where}")
        elif isinstance(cfg.get("num_target_layers"), int) and isinstance(cfg.get("num_hidden_layers"), int):
            tl = build_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
        else:
            raise LayerError(f"layers from:{path}: DFlash config without dflash_config.target_layer_ids "
                             f"or num_target_layers/num_hidden_layers")
        # SpecForge/z-lab read hidden_states[layer_id + 1] (hs[L] among them is final-normed, as
        # output_hidden_states gives it); DSpark also reads the final state.
        return [k + 1 for k in tl], "post", "DSpark" in arch
    eagle = cfg.get("eagle_config")
    if isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        aux = _int_list(eagle["eagle_aux_hidden_state_layer_ids"],
                        f"eagle_config.eagle_aux_hidden_state_layer_ids {where}")
        # SpecForge captures through SGLang, which adds 1 to each id.
        return [k + 1 for k in aux] + [L], "post", False
    if "Eagle3" in arch:                     # no ids: SpecForge's default for this target
        return (*preset_ids("specforge-eagle3", L), False)
    raise LayerError(f"layers from:{path}: no target layer ids found (looked for "
                     f"speculators' eagle_aux_hidden_state_layer_ids/aux_hidden_state_layer_ids, "
                     f"dflash_config.target_layer_ids, eagle_config.eagle_aux_hidden_state_layer_ids)")


def _int_list(value, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise LayerError(f"{what}: expected a non-empty list of integers, got {value!r}")
    return list(value)


def resolve_layers(spec: str, num_layers: int, last_layer_norm: str | None = None,
                   target_last: bool = False) -> LayerPlan:
    """A preset name, `from:<draft config.json>` or a comma list of hs indices -> LayerPlan.

    `target_last` adds hs[L] post-norm as a separate final state (SpecForge DSpark's
    `target_last_hidden_states`); a DSpark draft config asks for it itself."""
    L = num_layers
    spec = spec.strip()
    if spec in REFUSED:
        raise LayerError(f"layers {spec!r} is {REFUSED[spec]}; use one of {choices()}")
    if spec.startswith(FROM_PREFIX):
        path = os.path.expanduser(spec[len(FROM_PREFIX):])
        read = from_trainer_yaml if path.endswith((".yaml", ".yml")) else from_draft_config
        ids, norm, dspark = read(path, L)
        target_last = target_last or dspark
    elif spec.partition(":")[0] in PRESETS:
        try:
            ids, norm = preset_ids(spec, L)
        except KeyError:
            raise LayerError(f"layers {spec!r}: only specforge-dflash takes a ':' argument") from None
        ids = sorted(set(min(max(i, 0), L) for i in ids))       # tiny models: clamp, no repeats
    else:
        try:
            ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
        except ValueError:
            raise LayerError(f"layers {spec!r}: expected one of {choices()}") from None
        norm = "pre"
        if not ids:
            raise LayerError("layers is empty")
        if len(set(ids)) != len(ids):
            raise LayerError(f"layers {spec!r} repeats an index")
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise LayerError(f"layer id {bad[0]} out of range: this model has hs indices 0..{L}")
    if last_layer_norm is not None:
        norm = last_layer_norm
    if target_last:
        if L in ids:
            raise LayerError(f"target_last_hidden_states adds hs[{L}] post-norm as a separate final "
                             f"state, but hs[{L}] is already among these layers {list(ids)}")
        ids, norm = list(ids) + [L], "post"
    return LayerPlan(tuple(ids), norm if L in ids else "none", L, target_last)


def check_spec(spec: str) -> None:
    """Refuse a spec no model could resolve: what fleet checks in fleet.toml before any host is
    asked (names, syntax, repeats; ranges and draft configs are checked on the host)."""
    if spec.strip().startswith(FROM_PREFIX):
        if not spec.strip()[len(FROM_PREFIX):]:
            raise LayerError(f"layers {spec!r}: name the draft model's config.json after {FROM_PREFIX}")
        return
    resolve_layers(spec, 1 << 20)
