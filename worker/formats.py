"""Each trainer's file layout, in one place: where sample i goes, what its file holds, how it reads
back. The writer, `worker.verify` and `worker.export` all go through a Layout.

| format           | files (under the output folder)         | keys                                            |
|------------------|-----------------------------------------|-------------------------------------------------|
| speculators      | hs_<i>.safetensors                      | hidden_states bf16 [T, n, H], token_ids, loss_mask |
|   (dtype fp8)    |                                         | hidden_states float8_e4m3fn [T, n, H] + hidden_states_scales float32 [T, n, 1] |
| specforge-eagle3 | rows_<g>-<g+2000>/data_<i>.ckpt         | input_ids, loss_mask int64 [T], aux_hidden_state bf16 [1, T, 3H], hidden_state [1, T, H] |
| specforge-dflash | rows_<g>-<g+2000>/data_<i>.ckpt         | input_ids, loss_mask, hidden_states [1, T, k*H] (+ target_last_hidden_states [1, T, H]) |
| eagle            | data/rows_<g>-<g+2000>/data_<i>.ckpt    | input_ids [T], hidden_state [T, H], loss_mask [T] |

`manifest/` and `meta.json` stay at the top of the output folder: SpecForge's reader only lists
`*.ckpt`, speculators opens `hs_<i>.safetensors` by index, and EAGLE-1/2 (which `torch.load`s every
file under its data path) is pointed at `data/`. Temp files are written at the top too (a `.tmp-`
name no reader lists), then renamed into place.

Stored dtype: bf16 in every format; fp8 (worker/fp8.py) only where the trainer's reader
dequantises it: speculators (`--hidden-states-backend fp8`, hs_connectors' FP8Transfer). SpecForge's
`load_feature_file` and EAGLE-1/2's loader `torch.load` the tensors and use them as they are.
`load_sample(path)` reads any of these files back with bf16 hidden states.

Standard library at import (preflight checks a format without torch); torch is imported to read and
write.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from .layers import LayerPlan

FORMATS = ("speculators", "specforge-eagle3", "specforge-dflash", "eagle")
# How worker.data masks raw chats (rows with their own loss_mask keep it); meta.json says which.
LOSS_MASK_CONVENTIONS = {
    "assistant": "raw chats: each assistant turn from the end of the generation prompt through its "
                 "end-of-turn token (template-inserted text included); rows with loss_mask keep it",
    "assistant-content": "raw chats: the characters of each assistant message as found in the "
                         "rendering; rows with loss_mask keep it",
    "all": "raw chats: every token; rows with loss_mask keep it",
}
LOSS_MASKS = tuple(LOSS_MASK_CONVENTIONS)
ROWS_PER_FOLDER = 2000            # SpecForge's prepare_hidden_states groups rows like this
_CKPT_NAME = re.compile(r"data_(\d+)\.ckpt$")
_HS_NAME = re.compile(r"hs_(\d+)\.safetensors$")


class FormatError(Exception):
    """The layers asked for cannot be written in this format (or read back as it)."""


# Formats whose trainer's own reader dequantises fp8 files (checked against its code).
FP8_READERS = {"speculators": "speculators train --hidden-states-backend fp8 "
                              "(hs_connectors.transfer.FP8Transfer)"}
_NO_FP8 = {"specforge-eagle3": "SpecForge's load_feature_file", "specforge-dflash": "SpecForge's load_feature_file",
           "eagle": "EAGLE-1/2's torch.load"}


def check_dtype(fmt: str, dtype: str) -> None:
    """Refuse, with one line, a stored dtype this format's trainer cannot read."""
    if dtype not in ("bf16", "fp8"):
        raise FormatError(f"dtype {dtype!r}: expected bf16 or fp8")
    if dtype == "fp8" and fmt not in FP8_READERS:
        raise FormatError(f"dtype fp8: format {fmt} is read by {_NO_FP8.get(fmt, 'a reader')}, which cannot "
                          f"dequantise fp8 (only speculators can); use dtype = \"bf16\", or format = "
                          f"\"speculators\" and `fleet export --format {fmt}` later (written in bf16)")


def check_plan(fmt: str, plan: LayerPlan) -> None:
    """Refuse, with one line, layers that this trainer's reader would misread."""
    if fmt not in FORMATS:
        raise FormatError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    L, ids = plan.num_layers, plan.ids
    if fmt == "speculators" and ids and ids[-1] == L and plan.last_layer_norm == "post":
        raise FormatError(f"format speculators: its trainer applies the final norm to the last slot "
                          f"itself (verifier_norm), so hs[{L}] post-norm would be normed twice; use "
                          f"layers = \"speculators\" (hs[{L}] pre-norm), or the format of the trainer "
                          f"these layers are for (specforge-eagle3)")
    if fmt == "specforge-eagle3":
        if len(ids) != 4 or ids[-1] != L or plan.last_layer_norm != "post" or L in ids[:-1]:
            raise FormatError(f"format specforge-eagle3 reads 3 aux layers + hs[{L}] post-norm "
                              f"(layers = \"specforge-eagle3\"); these layers are {list(ids)} with "
                              f"hs[L] {plan.last_layer_norm}")
    elif fmt == "specforge-dflash":
        if plan.target_last and (ids[-1] != L or plan.last_layer_norm != "post"):
            raise FormatError(f"target_last_hidden_states must be hs[{L}] post-norm")
        if not context_slots(fmt, plan):
            raise FormatError("format specforge-dflash needs at least one context layer")
        if L in [ids[k] for k in context_slots(fmt, plan)] and plan.last_layer_norm != "post":
            raise FormatError(f"format specforge-dflash reads hs[{L}] (target layer id {L - 1}) "
                              f"final-normed, as output_hidden_states gives it; these layers hold it "
                              f"{plan.last_layer_norm}-norm: extract with format = \"specforge-dflash\"")
    elif fmt == "eagle":
        if ids != (L,) or plan.last_layer_norm != "post":
            raise FormatError(f"format eagle (EAGLE-1/2) reads hs[{L}] post-norm only "
                              f"(layers = \"eagle\"); these layers are {list(ids)}")


# The window each trainer reads of a sample by default (it cuts the rest off at load): SpecForge's
# data.max_length (config/schema.py), EAGLE-1/2's max_len (train/main.py), speculators'
# --total-seq-len (a packed batch; its collator clips there). `[run] max_length` replaces it.
TRAINER_WINDOW = {"speculators": 8192, "specforge-eagle3": 2048, "specforge-dflash": 2048, "eagle": 2048}
_WINDOW_NAME = {"speculators": "speculators' --total-seq-len", "specforge-eagle3": "SpecForge's data.max_length",
                "specforge-dflash": "SpecForge's data.max_length", "eagle": "EAGLE-1/2's max_len"}


def supervision_problem(fmt: str, loss_mask, max_length: int | None = None) -> str | None:
    """Why a sample teaches this trainer nothing (then it is skipped, not written), or None; judged
    inside the window the trainer reads (`max_length`, else its default).

    SpecForge's DFlash normaliser raises on a sample without two consecutive supervised tokens."""
    window = max_length or TRAINER_WINDOW.get(fmt)
    where = "" if window is None or len(loss_mask) <= window else \
        f" within the first {window} tokens ({'max_length' if max_length else _WINDOW_NAME[fmt]}, " \
        f"where the trainer cuts the sample; [run] max_length sets yours)"
    mask = loss_mask[:window]
    if not mask.any():
        return f"no supervised token{where}" if where else "no supervised token (loss_mask is all 0)"
    if fmt == "specforge-dflash" and not (mask[:-1] & mask[1:]).any():
        return f"no two consecutive supervised tokens{where} (SpecForge DFlash needs them)"
    return None


def trainer_setting(fmt: str, plan: LayerPlan, dtype: str = "bf16") -> str:
    """The flag or draft-config value with which this format's trainer reads exactly these layers
    (its own numbering: speculators' ids are hs indices, SpecForge's are hs index - 1), and for
    fp8 files the reader that dequantises them (without it speculators trains on raw fp8 values)."""
    ctx = [plan.ids[s] for s in context_slots(fmt, plan)]
    if fmt == "speculators":                 # it splits the last slot off as the verifier state
        return "--target-layer-ids " + " ".join(map(str, plan.ids[:-1])) + \
            (" --hidden-states-backend fp8" if dtype == "fp8" else "")
    if fmt == "specforge-eagle3":
        return f"model.aux_hidden_state_layer_ids = {[k - 1 for k in ctx]}"
    if fmt == "specforge-dflash":
        return f"dflash_config.target_layer_ids = {[k - 1 for k in ctx]}"
    return "none: EAGLE-1/2 reads the final-normed last layer only"


def context_slots(fmt: str, plan: LayerPlan) -> list[int]:
    """Slots of the captured [T, n, H] that a trainer concatenates as its input features."""
    n = len(plan.ids)
    if fmt == "specforge-eagle3" or (fmt == "specforge-dflash" and plan.target_last):
        return list(range(n - 1))
    if fmt == "eagle":
        return []
    return list(range(n))


@dataclass(frozen=True)
class Layout:
    """One format with the layers it holds and the dtype it stores: paths, file contents, reading
    back."""
    format: str
    plan: LayerPlan
    dtype: str = "bf16"                  # bf16 | fp8 (worker/fp8.py)
    strict: bool = True                  # False: reading a folder written before a refusal existed

    def __post_init__(self) -> None:
        if self.strict:
            check_plan(self.format, self.plan)
            check_dtype(self.format, self.dtype)

    # --- where --------------------------------------------------------------------------------
    def data_dir(self, out: str) -> str:
        """The folder the trainer is pointed at."""
        return os.path.join(out, "data") if self.format == "eagle" else out

    def path(self, out: str, index: int) -> str:
        if self.format == "speculators":
            return os.path.join(out, f"hs_{index}.safetensors")
        g = index // ROWS_PER_FOLDER * ROWS_PER_FOLDER
        return os.path.join(self.data_dir(out), f"rows_{g}-{g + ROWS_PER_FOLDER}", f"data_{index}.ckpt")

    def scan(self, out: str) -> dict[int, str]:
        """Every sample file on disk, by index (what verify compares with the manifests)."""
        found: dict[int, str] = {}
        top = self.data_dir(out)
        if self.format == "speculators":
            names = os.listdir(top) if os.path.isdir(top) else []
            walk = [(top, names)]
        else:
            walk = [(root, names) for root, _, names in os.walk(top)]
        pattern = _HS_NAME if self.format == "speculators" else _CKPT_NAME
        for root, names in walk:
            for name in names:
                m = pattern.fullmatch(name)
                if m:
                    found[int(m.group(1))] = os.path.join(root, name)
        return found

    # --- what ---------------------------------------------------------------------------------
    def pack(self, hidden, token_ids, loss_mask, scales=None) -> dict:
        """One sample's file contents from hidden [T, n, H], token_ids and loss_mask [T].

        `hidden` is bf16, or fp8 with its `scales` [T, n, 1] (what the writer's GPU quantised);
        it is quantised or dequantised here when this layout stores the other dtype.
        Every tensor is a fresh, compact copy: torch.save writes a view's whole storage."""
        import torch

        from . import fp8

        T, n, H = hidden.shape
        ids = torch.as_tensor(token_ids, dtype=torch.int64).clone()
        mask = torch.as_tensor(loss_mask)
        if scales is not None and self.dtype != "fp8":
            hidden, scales = fp8.dequantize(hidden, scales), None
        if self.format == "speculators":
            if self.dtype == "fp8":
                if scales is None:
                    hidden, scales = fp8.quantize(hidden)
                return {"hidden_states": hidden, fp8.SCALES_KEY: scales, "token_ids": ids,
                        "loss_mask": mask.to(torch.uint8)}
            return {"hidden_states": hidden, "token_ids": ids, "loss_mask": mask.to(torch.uint8)}
        mask = mask.to(torch.int64).clone()
        ctx = self._compact(hidden[:, context_slots(self.format, self.plan)].reshape(T, -1))
        if self.format == "specforge-eagle3":
            return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": ctx[None],
                    "hidden_state": self._compact(hidden[:, n - 1])[None]}
        if self.format == "specforge-dflash":
            out = {"input_ids": ids, "loss_mask": mask, "hidden_states": ctx[None]}
            if self.plan.target_last:
                out["target_last_hidden_states"] = self._compact(hidden[:, n - 1])[None]
            return out
        return {"input_ids": ids, "hidden_state": self._compact(hidden[:, 0]), "loss_mask": mask}

    @staticmethod
    def _compact(t):
        import torch
        return t.to(torch.bfloat16).clone(memory_format=torch.contiguous_format)

    def unpack(self, tensors: dict) -> tuple[Any, Any, Any]:
        """(hidden [T, n, H] bf16, token_ids [T], loss_mask [T]) back from a file's contents
        (fp8 files dequantised)."""
        import torch

        if self.format == "speculators":
            from . import fp8
            hidden = tensors["hidden_states"]
            if fp8.SCALES_KEY in tensors:
                hidden = fp8.dequantize(hidden, tensors[fp8.SCALES_KEY])
            return hidden, tensors["token_ids"], tensors["loss_mask"]
        ids, mask = tensors["input_ids"].reshape(-1), tensors["loss_mask"].reshape(-1)
        T = ids.shape[0]
        if self.format == "eagle":
            return tensors["hidden_state"].reshape(T, 1, -1), ids, mask
        key = "aux_hidden_state" if self.format == "specforge-eagle3" else "hidden_states"
        H = self._hidden_size(tensors)
        parts = [tensors[key].reshape(T, -1, H)]
        if self.format == "specforge-eagle3":
            parts.append(tensors["hidden_state"].reshape(T, 1, H))
        elif self.plan.target_last:
            parts.append(tensors["target_last_hidden_states"].reshape(T, 1, H))
        return torch.cat(parts, dim=1), ids, mask

    def _hidden_size(self, tensors: dict) -> int:
        key = "aux_hidden_state" if self.format == "specforge-eagle3" else "hidden_states"
        return tensors[key].shape[-1] // len(context_slots(self.format, self.plan))

    def header(self) -> dict[str, str]:
        """Header metadata of a speculators file (ckpt files hold only what their readers load)."""
        from .fp8 import SCALE_LAYOUT, TORCH_NAMES
        head = {"layer_ids": ",".join(map(str, self.plan.ids)),
                "last_layer_norm": self.plan.last_layer_norm, "format": "fleet-hs-1",
                "dtype": TORCH_NAMES[self.dtype]}
        if self.dtype == "fp8":
            head["scale_layout"] = SCALE_LAYOUT
        return head

    def stored(self) -> dict:
        """What meta.json says about the stored hidden states: dtype and, for fp8, the scales."""
        from .fp8 import SCALE_LAYOUT, SCALES_KEY, TORCH_NAMES
        out: dict = {"dtype": TORCH_NAMES[self.dtype]}
        if self.dtype == "fp8":
            out["hidden_states_scales"] = {
                "key": SCALES_KEY, "dtype": "float32", "shape": "[T, n_layers, 1]",
                "layout": SCALE_LAYOUT, "rule": "smallest power of two with amax / scale <= 464",
                "dequantize": f"hidden_states.to(bfloat16) * {SCALES_KEY}.to(bfloat16)"}
        return out

    def bytes_per_token(self, hidden_size: int) -> int:
        """Bytes a token costs in this layout's files: hidden states (+ scales) and ids + mask."""
        ids_mask = 8 + (1 if self.format == "speculators" else 8)      # int64 ids; uint8 / int64 mask
        return payload_bytes(1, len(self.plan.ids), hidden_size, self.dtype) + ids_mask

    def bytes_per_file(self) -> int:
        """A file's fixed cost beyond its tokens: safetensors' header, torch.save's zip records."""
        return FILE_OVERHEAD[self.format] + (FP8_FILE_OVERHEAD if self.dtype == "fp8" else 0)

    # --- files --------------------------------------------------------------------------------
    def save(self, tensors: dict, path: str, metadata: dict[str, str]) -> None:
        if self.format == "speculators":
            from safetensors.torch import save_file
            save_file(tensors, path, metadata=metadata)
        else:
            import torch
            with open(path, "wb") as f:     # a file object: torch names the archive after a path
                torch.save(tensors, f)      # what every ckpt reader torch.loads; no extra keys

    def load(self, path: str) -> tuple[dict, dict]:
        """(tensors, metadata) of one file; raises on a missing or damaged file."""
        if self.format == "speculators":
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
        import torch
        return torch.load(path, map_location="cpu", weights_only=True), {}

    def check(self, tensors: dict, tokens: int | None, hidden_size: int | None) -> str | None:
        """What is wrong with one file's contents, or None."""
        import torch

        from . import fp8

        want = {"speculators": ("hidden_states", "token_ids", "loss_mask")
                + ((fp8.SCALES_KEY,) if self.dtype == "fp8" else ()),
                "specforge-eagle3": ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"),
                "specforge-dflash": ("input_ids", "loss_mask", "hidden_states")
                + (("target_last_hidden_states",) if self.plan.target_last else ()),
                "eagle": ("input_ids", "hidden_state", "loss_mask")}[self.format]
        if self.format == "speculators" and "hidden_states" in tensors:
            expected = fp8.FP8 if self.dtype == "fp8" else torch.bfloat16
            if tensors["hidden_states"].dtype != expected:
                return f"hidden states dtype {tensors['hidden_states'].dtype}, expected {expected}"
        missing = [k for k in want if k not in tensors]
        if missing:
            return f"keys {missing} missing"
        if self.format == "speculators" and self.dtype == "fp8":
            if problem := self._check_scales(tensors["hidden_states"], tensors[fp8.SCALES_KEY]):
                return problem
        try:
            hidden, ids, mask = self.unpack(tensors)
        except (RuntimeError, ValueError, ZeroDivisionError) as e:
            return f"shapes do not fit the layers: {e}"
        expect = (tokens, len(self.plan.ids) or None, hidden_size)
        if hidden.dim() != 3 or any(e is not None and e != s for e, s in zip(expect, hidden.shape)):
            return f"hidden states shape {tuple(hidden.shape)}, expected {expect}"
        if hidden.dtype != torch.bfloat16:
            return f"hidden states dtype {hidden.dtype}, expected bfloat16"
        if ids.shape != (hidden.shape[0],) or mask.shape != (hidden.shape[0],):
            return "token ids / loss_mask length differs from the hidden states"
        if not bool(torch.isfinite(hidden).all()):
            return "non-finite values"
        return None

    @staticmethod
    def _check_scales(values, scales) -> str | None:
        import torch

        from .fp8 import SCALES_KEY
        T, n, _ = values.shape
        if scales.dtype != torch.float32 or tuple(scales.shape) != (T, n, 1):
            return (f"{SCALES_KEY} {scales.dtype} {tuple(scales.shape)}, expected float32 {(T, n, 1)} "
                    f"(one scale per token per layer)")
        if not bool((torch.isfinite(scales) & (scales > 0)).all()):
            return f"{SCALES_KEY} holds a scale that is not a positive finite number"
        return None


def payload_bytes(tokens: int, layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of hidden states (and fp8's float32 scale per token per layer) for `tokens` tokens."""
    if dtype == "fp8":
        return tokens * layers * (hidden_size + 4)
    return tokens * layers * hidden_size * 2


# A file's fixed bytes beyond its tensors, measured on the files the worker writes (safetensors'
# JSON header with our metadata, + the scales' entry for fp8; torch.save's zip records, each
# tensor's data aligned to 64 bytes). preflight's projection adds it per sample.
FILE_OVERHEAD = {"speculators": 360, "specforge-eagle3": 2300, "specforge-dflash": 2300, "eagle": 2050}
FP8_FILE_OVERHEAD = 120


def load_sample(path: str) -> dict:
    """One sample file of any format, with its hidden states in bf16 (fp8 files dequantised, the
    scales dropped, as speculators' FP8Transfer hands them to its trainer). Needs only torch and
    safetensors: `from worker.formats import load_sample`."""
    import torch

    from . import fp8

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        tensors = load_file(path)
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    if fp8.SCALES_KEY in tensors:
        scales = tensors.pop(fp8.SCALES_KEY)
        tensors["hidden_states"] = fp8.dequantize(tensors["hidden_states"], scales)
    return tensors
