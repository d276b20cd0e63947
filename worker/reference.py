"""A sample of each shard's rows computed again through the model's own plain forward, and compared
with what the shard wrote for them (issue 36).

The fast paths are where silent wrong output lives (compiled regions, fla kernels, batching by
length with padding, fp8 storage); a drafter trained on it is found out a day later. So a fixed
pseudo-random 1 in N of a shard's rows, and every k-th index so that a shard has at least MIN_ROWS
(spread over the run: the choice is by index, and rows come longest first) is run again alone — batch of one, eager (compiled
forwards set aside, fla's kernels swapped for transformers' own), no padding, through
`output_hidden_states` — and each saved layer is compared with the file's contents as written (fp8
dequantised): cosine and relative error against a tolerance per stored dtype. A row that fails
stops the shard for good, naming the layer, the row and the numbers: nothing is worse than output
that is wrong without a word.

A checked row that was a raw chat has its loss mask, as written, compared with the chat template's
rendering too (worker/maskcheck.py); a mask off the assistant turns stops the shard the same way.

Each check is a line of `<out>/checks/<shard>.jsonl` (the row, each layer's cosine and relative
error, the mask's counts), which verify reads, and a `checked` event with the shard's count and
worst cosine per layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from typing import Iterator, Sequence

import torch

from . import protocol
from .formats import Layout
from .maskcheck import check_mask
from .model import find_decoder, model_devices
from .writer import disk_full_says

CHECKS_DIR = "checks"
EVERY = 2000                     # 1 in this many rows, by default
MIN_ROWS = 8                     # and at least this many a shard
# What the comparison allows, by how the states are stored (the README's table). Measured on an
# H100 (docs/benchmarks.md): a batch of one, eager, against the compiled, padded batch differs by
# up to 0.079 relative error (cosine 0.9969) at the 27B hybrid's last layer in bf16, 0.066 at a 7B's
# in fp8; every bug the tests inject is far beyond (cosine under 0.95, relative error over 0.5).
TOLERANCE = {"bf16": {"cosine": 0.98, "rel_err": 0.15}, "fp8": {"cosine": 0.97, "rel_err": 0.25}}


class CheckFailed(Exception):
    """The written states of a row are not the model's: a restart would write them wrong again."""


def checks_path(out_dir: str, shard: int) -> str:
    return os.path.join(out_dir, CHECKS_DIR, f"{shard}.jsonl")


def chosen(index: int, every: int, stride: int) -> bool:
    """Whether row `index` is one of the checked: a fixed pseudo-random 1 in `every` by index, and
    every `stride`-th index (so any `stride * MIN_ROWS` consecutive rows hold MIN_ROWS of them) —
    the same choice on every launch and host, so a resumed shard checks the rows it would have."""
    h = int.from_bytes(hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest(), "little")
    return index % stride == 0 or h < 2 ** 64 // every


def stride_for(rows: int) -> int:
    """The spacing that gives a shard of `rows` at least MIN_ROWS checks."""
    return max(1, rows // MIN_ROWS)


class ReferenceChecks:
    """The shard's checks: the writer hands in the chosen rows as it writes them (`written`, from
    its thread), the GPU loop runs them between batches (`run`, raising CheckFailed)."""

    def __init__(self, model: torch.nn.Module, layout: Layout, out_dir: str, shard: int, every: int,
                 rows: int, emit, path_note: str = "", tokenizer=None, loss_mask: str = "assistant"):
        self.model, self.layout, self.emit = model, layout, emit
        self.tokenizer, self.loss_mask = tokenizer, loss_mask   # a raw chat's mask is checked too
        self.every, self.stride = every, stride_for(rows)
        self.path_note = path_note                 # which forward path the shard runs (the failure names it)
        self.file = checks_path(out_dir, shard)
        os.makedirs(os.path.dirname(self.file), exist_ok=True)
        self.decoder = find_decoder(model)
        self.device = model_devices(model, next(model.parameters()).device)[0]
        self.pending: list[tuple[int, dict, list | None]] = []
        self.lock = threading.Lock()
        self.count, self.masks, self.seconds = 0, 0, 0.0
        self.worst_cos: list[float] = []          # per saved layer, over the rows checked so far
        self.worst_rel: list[float] = []
        for rec in protocol.iter_jsonl(self.file):         # an earlier launch's checks count on
            if isinstance(rec.get("cosine"), list) and isinstance(rec.get("rel_err"), list):
                self._count(rec["cosine"], rec["rel_err"])
                self.masks += isinstance(rec.get("mask"), dict)

    def wanted(self, index: int) -> bool:
        return chosen(index, self.every, self.stride)

    def written(self, index: int, tensors: dict, chat: list | None = None) -> None:
        """A chosen row's file contents, as written, and its chat's messages where it was one (the
        writer's thread)."""
        with self.lock:
            self.pending.append((index, tensors, chat))

    def run(self, capture=None) -> None:
        """Every chosen row written so far, checked (on the GPU loop's thread, between batches)."""
        with self.lock:
            todo, self.pending = self.pending, []
        for index, tensors, chat in todo:
            t0 = time.perf_counter()
            mask = None
            compared: tuple[list[float], list[float], list[int]] | None = None
            try:
                hidden, ids, written = self.layout.unpack(tensors)     # (fp8 dequantised once)
                compared = self.compare(hidden, ids)
                if chat is not None and self.tokenizer is not None:
                    mask = check_mask(chat, ids.numpy(), written.numpy(), self.tokenizer(), self.loss_mask)
            except Exception as e:                     # the check could not run (out of memory alone with
                compared = None                        # every layer kept, say): said, never the data's fault
                self.not_run(index, e)
            finally:
                if capture is not None:                # its hooks fired: their tensors are not a batch's
                    capture.slots = [None] * len(capture.slots)
                self.seconds += time.perf_counter() - t0
            if compared is not None:
                cos, rel, silent = compared
                self._record(index, cos, rel, mask, silent)

    def not_run(self, index: int, e: Exception) -> None:
        """A check that could not run: a warning naming the row, and the GPU's cache emptied."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        self.emit(protocol.WarningEvent(message=f"reference check of row {index:,} not run: "
                                                f"{type(e).__name__}: {why}"))

    def compare(self, hidden: torch.Tensor, ids) -> tuple[list[float], list[float], list[int]]:
        """Each saved layer's (cosine, relative error) of the written states (`hidden` [T, n, H], as
        Layout.unpack gives them) against the reference forward of `ids`, and the saved layers where
        the reference itself is all zero (the model gives nothing there, whatever the path)."""
        ids = torch.as_tensor(ids).reshape(-1).long()
        with torch.inference_mode(), eager(self.model):
            out = self.model(input_ids=ids[None].to(self.device), use_cache=False, output_hidden_states=True)
        ref = out.hidden_states
        plan, cos, rel, silent = self.layout.plan, [], [], []
        for slot, k in enumerate(plan.ids):
            mine = hidden[:, slot].float()
            want = ref[k][0].float().cpu()
            if not want.abs().max() > 0:
                silent.append(k)
            if k == plan.num_layers and plan.last_layer_norm == "pre":   # hs[L] is final-normed there
                with torch.inference_mode():
                    norm = self.decoder.norm
                    weight = next(norm.parameters(), None)
                    where = weight.device if weight is not None else self.device
                    mine = norm(mine.to(where, weight.dtype if weight is not None else torch.float32)).float().cpu()
            c, r = agreement(mine, want)
            cos.append(c)
            rel.append(r)
        return cos, rel, silent

    def _count(self, cos: list[float], rel: list[float]) -> None:
        self.count += 1
        self.worst_cos = [min(a, b) for a, b in zip(self.worst_cos, cos)] if self.worst_cos else list(cos)
        self.worst_rel = [max(a, b) for a, b in zip(self.worst_rel, rel)] if self.worst_rel else list(rel)

    def _record(self, index: int, cos: list[float], rel: list[float], mask=None, silent: Sequence[int] = ()) -> None:
        tol = TOLERANCE[self.layout.dtype]
        self._count(cos, rel)
        line = {"index": index, "cosine": [round(c, 6) for c in cos], "rel_err": [round(r, 6) for r in rel]}
        if mask is not None:
            self.masks += 1
            line["mask"] = mask.line() | ({"problem": mask.problem} if mask.problem else {})
        with disk_full_says(self.file):
            protocol.append_jsonl(self.file, line)
        ids = list(self.layout.plan.ids)
        bad = [(k, c, r) for k, c, r in zip(ids, cos, rel) if c < tol["cosine"] or r > tol["rel_err"]]
        why = model_silent(silent[0], index) if silent else failure(bad[0], index, self.path_note) if bad else \
            f"row {index:,}: its loss mask: {mask.problem}" if mask is not None and mask.problem else None
        self.emit(protocol.Checked(rows=self.count, layer_ids=ids, worst_cosine=[round(c, 6) for c in self.worst_cos],
                                   worst_rel_err=[round(r, 6) for r in self.worst_rel], seconds=round(self.seconds, 3),
                                   masks=self.masks, failed=why))
        if why:
            raise CheckFailed(why)


def model_silent(k: int, index: int) -> str:
    """Why a row's states teach nothing where the model itself gives none: not the extraction's doing."""
    return (f"layer {k} of row {index:,}: the model itself gives all-zero hidden states there (its own "
            f"forward, batch of one, eager, as well as what was written): the model is wrong, not the "
            f"extraction — check its weights (a checkpoint of zeros, a bad conversion?)")


def failure(bad: tuple[int, float, float], index: int, path: str) -> str:
    k, c, r = bad
    return (f"layer {k} of row {index:,}: cosine {c:.3f}, relative error {r:.3f} against the reference "
            f"forward (batch of one, eager); the written states are wrong"
            + (f" — its path: {path}" if path else ""))


def agreement(mine: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(cosine, relative error) of two [T, H] tensors, in float64; states of zero norm agree with
    nothing (cosine 0)."""
    a, b = mine.double().flatten(), want.double().flatten()
    na, nb = a.norm(), b.norm()
    if a.shape != b.shape:
        return 0.0, float("inf")
    cos = float(a @ b / (na * nb)) if na > 0 and nb > 0 else 0.0
    return cos, float((a - b).norm() / nb) if nb > 0 else float("inf")


@contextlib.contextmanager
def eager(model: torch.nn.Module) -> Iterator[None]:
    """The model as transformers wrote it, for the length of a reference forward: the forwards
    worker.model compiled set aside, and a Gated DeltaNet's fla kernels swapped for transformers'
    own torch implementations (where its module has them); all put back after."""
    compiled, swapped = [], []
    for module in model.modules():
        if module.__dict__.get("_fleet_compiled") and "forward" in module.__dict__:
            compiled.append((module, module.__dict__.pop("forward")))
        home = sys.modules.get(type(module).__module__)
        for attr, plain in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                            ("recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                            ("causal_conv1d_fn", None), ("causal_conv1d_update", None)):
            if attr in module.__dict__ and home is not None and (plain is None or hasattr(home, plain)):
                swapped.append((module, attr, module.__dict__[attr]))
                setattr(module, attr, getattr(home, plain) if plain else None)
    try:
        yield
    finally:
        for module, forward in compiled:
            module.__dict__["forward"] = forward
        for module, attr, value in swapped:
            setattr(module, attr, value)
