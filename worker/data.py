"""Reading a shard of the dataset: pre-tokenized rows or raw chats, each row by its global index.

Global index = row number in the dataset (for JSONL, the line number counted from 0). Shards are
contiguous index ranges, so output files named by global index make a resume independent of how
many shards there are.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .datafiles import DatasetFilesError, data_files, jsonl_row_count
from .ranges import shard_range  # noqa: F401  (the rows of a shard: one definition, worker/ranges.py)


class DataError(Exception):
    """The dataset as a whole cannot be read (missing path, unknown format)."""


@dataclass
class Sample:
    index: int
    input_ids: np.ndarray      # int64 [T]
    loss_mask: np.ndarray      # uint8 [T]
    chat: list[dict] | None = None   # a raw chat's messages (the mask check renders them again)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class BadRow:
    index: int
    reason: str


# --- formats -----------------------------------------------------------------------------------

class Dataset:
    """A dataset on disk: knows its row count and yields raw rows (dict) or BadRow by index."""

    num_rows: int

    def rows(self, start: int, stop: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError


class JsonlDataset(Dataset):
    def __init__(self, path: str):
        self.path = path
        self.num_rows = jsonl_row_count(path)

    def rows(self, start: int, stop: int) -> Iterator[tuple[int, Any]]:
        with open(self.path, "rb") as f:
            for index, raw in enumerate(f):
                if index < start:
                    continue
                if index >= stop:
                    break
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield index, BadRow(index, f"not UTF-8 at byte {e.start}")
                    continue
                if not text.strip():
                    yield index, BadRow(index, "empty line")
                    continue
                try:
                    yield index, json.loads(text)
                except ValueError as e:
                    yield index, BadRow(index, f"not valid JSON: {e}")


class ArrowTableDataset(Dataset):
    """Parquet file(s) or a Hugging Face `save_to_disk` folder, read through pyarrow in slices."""

    def __init__(self, table: Any):
        self.table = table
        self.num_rows = table.num_rows

    def rows(self, start: int, stop: int) -> Iterator[tuple[int, Any]]:
        step = 1024
        for lo in range(start, stop, step):
            part = self.table.slice(lo, min(step, stop - lo)).to_pylist()
            for offset, row in enumerate(part):
                yield lo + offset, row


def _arrow_table(path: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        files = data_files(path)
    except DatasetFilesError as e:
        raise DataError(str(e)) from None
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json")):   # save_to_disk
        tables = []
        for name in files:
            with pa.memory_map(name) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        return pa.concat_tables(tables)
    return pa.concat_tables(pq.read_table(f, memory_map=True) for f in files)


def open_dataset(path: str) -> Dataset:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder")
    if os.path.isdir(path) or path.endswith(".parquet"):
        return ArrowTableDataset(_arrow_table(path))
    if path.endswith((".jsonl", ".json")):
        return JsonlDataset(path)
    raise DataError(f"{path}: unknown dataset format (expected .jsonl, .parquet or a folder)")


# --- rows to samples ---------------------------------------------------------------------------

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
          "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
          "ipython": "ipython"}
_TURN_KEYS = ("role", "from", "content", "value")


def _chat_messages(row: dict) -> list[dict]:
    """`messages` or `conversations`, each a list of turns with `role`/`content` (OpenAI) or
    `from`/`value` (ShareGPT) keys. A turn's other keys (`tool_calls`, `reasoning_content`,
    `tool_call_id`, `name`) go to the chat template as they are; an assistant turn with
    `tool_calls` may have no text."""
    turns = row["messages"] if "messages" in row else row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("conversation is empty or not a list")
    messages = []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {n} is not an object")
        said = turn.get("role", turn.get("from"))
        role = _ROLES.get(str(said or "").lower())
        text = turn.get("content", turn.get("value"))
        if role is None:
            raise ValueError(f"turn {n} has unknown role {said!r}")
        if text is None and turn.get("tool_calls"):
            text = ""
        if not isinstance(text, str):
            raise ValueError(f"turn {n} has no text")
        messages.append({"role": role, "content": text,
                         **{k: v for k, v in turn.items() if k not in _TURN_KEYS}})
    return messages


def tokenize_chat(messages: list[dict], tokenizer: Any, mode: str = "assistant"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Render with the model's chat template; loss_mask = 1 on the tokens the trainers supervise.

    `assistant` (what SpecForge, speculators and EAGLE train on): each assistant turn from the end
    of the generation prompt through its end-of-turn token, template-inserted text (an empty
    `<think></think>`) included. `assistant-content`: the characters of each assistant message
    found in the rendering (misses the end-of-turn token, and turns a template trims). `all`.
    """
    text = _render(tokenizer, messages, False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    if mode == "all":
        return ids, np.ones(len(ids), dtype=np.uint8)
    if mode == "assistant-content":
        spans = _content_spans(messages, text)
    else:
        spans = [_turn_span(messages, i, text, tokenizer)
                 for i, m in enumerate(messages) if m["role"] == "assistant"]
    mask = np.zeros(len(ids), dtype=np.uint8)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if any(a < e and b > s for s, e in spans):
            mask[t] = 1
    return ids, mask


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:                  # a template's raise_exception(): this row's problem
        if type(e).__module__.startswith("jinja2"):
            raise ValueError(f"chat template: {e}") from None
        raise


def _content_spans(messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant message's text, searched for in order."""
    spans, pos = [], 0
    for m in messages:
        at = text.find(m["content"], pos) if m["content"] else -1
        if at < 0:
            continue
        if m["role"] == "assistant":
            spans.append((at, at + len(m["content"])))
        pos = at + len(m["content"])
    return spans


def _turn_span(messages: list[dict], i: int, text: str, tokenizer: Any) -> tuple[int, int]:
    """Characters of assistant turn `i` in the full rendering `text`, from the end of the
    generation prompt through the turn's end-of-turn token.

    The start is where the conversation before the turn, rendered with the generation prompt,
    stops matching `text`: all of it, except a prefill the template puts in the prompt but drops
    from earlier turns (`<think>\n` of Qwen3-Thinking-2507 and QwQ). The first turn's prompt is the
    empty conversation's, so a default system prompt the template adds is not supervised. The
    end-of-turn token is the last special token of the turn rendered as the last message (after it
    comes only whitespace); its first occurrence from the start ends the turn in `text` (a template
    may render a turn differently once later turns follow it, e.g. Qwen3 drops the empty think
    block, so the turn's own rendering cannot be measured). Trainers differ on the newline after
    `<|im_end|>`: SpecForge's Qwen pattern supervises it, this mask (like speculators') stops at
    the token."""
    before, plain = _prompt_before(messages, i, tokenizer, text)
    if i and before == plain:
        raise DataError("the chat template adds no generation prompt (add_generation_prompt "
                        "changes nothing), so an assistant turn's start is unknown: use "
                        "loss_mask = \"assistant-content\" or \"all\"")
    start = common_prefix(before, text, tokenizer)
    if not text.startswith(plain) or start < len(plain):
        raise ValueError(f"turn {i}: the chat template renders the conversation before it "
                         f"differently on its own")
    own = _render(tokenizer, messages[: i + 1], False)
    if not own.startswith(text[:start]):
        raise ValueError(f"turn {i}: the chat template renders its generation prompt differently "
                         f"from the turn")
    turn = own[start:].rstrip()
    eot = _last_special_token(tokenizer, turn)
    if eot is not None:
        at = text.find(eot, start)
        if at >= 0:
            return start, at + len(eot)
    if text.startswith(turn, start):                 # no special end marker: the turn as rendered
        return start, start + len(turn)
    raise ValueError(f"turn {i}: cannot find where it ends in the rendered conversation")


def common_prefix(a: str, b: str, tokenizer: Any) -> int:
    """How far two renderings agree, never into an added token (`<|im_end|>`, `<think>`) either of
    them has there: a prompt ending in `<think>` and a turn that is only `<|im_end|>` agree on the
    `<`, and a turn would start inside its end-of-turn token (and, that searched on, run into the
    next user turn). Every chat row's every turn comes here: the tokens are one cached pattern,
    tried only at the positions a token could start and still reach past the agreement."""
    at = len(os.path.commonprefix([a, b]))
    pattern, longest = _added_tokens(tuple(getattr(t, "content", "") for t in
                                           getattr(tokenizer, "added_tokens_decoder", {}).values()))
    moved = True
    while pattern is not None and moved:
        moved = False
        for p in range(max(0, at - longest + 1), at):
            if any((m := pattern.match(s, p)) and m.end() > at for s in (a, b)):
                at, moved = p, True
                break
    return at


@functools.lru_cache(maxsize=16)
def _added_tokens(contents: tuple[str, ...]) -> tuple[re.Pattern | None, int]:
    """The added tokens as one pattern, longest first (so the one found at a position reaches
    furthest), and the longest's length."""
    tokens = sorted({c for c in contents if c}, key=len, reverse=True)
    if not tokens:
        return None, 0
    return re.compile("|".join(map(re.escape, tokens))), len(tokens[0])


def _prompt_before(messages: list[dict], i: int, tokenizer: Any, text: str) -> tuple[str, str]:
    """(the conversation before turn i with the generation prompt, and without). Before a first
    turn that is the empty conversation's rendering (a default system prompt); where a template
    cannot render an empty conversation (Qwen3, QwQ and Llama-3.3 read messages[0]), `text` up to
    where the first message's content begins (found by rendering it with other content)."""
    try:
        return _render(tokenizer, messages[:i], True), _render(tokenizer, messages[:i], False)
    except (ValueError, IndexError, TypeError):
        if i:
            raise
    probe = _render(tokenizer, [{**messages[0], "content": "\x00"}], False)
    return text[:len(os.path.commonprefix([probe, text]))], ""


def _last_special_token(tokenizer: Any, turn: str) -> str | None:
    """The turn's last token, if it is one of the tokenizer's added special tokens."""
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)}
    return tokenizer.convert_ids_to_tokens(ids[-1]) if ids[-1] in special else None


def _mask_from_row(raw: Any, length: int) -> np.ndarray | str:
    """A row's own loss_mask: only 0/1 integers or booleans (the string "0" is not false), else
    the reason it is refused."""
    if not isinstance(raw, (list, tuple)) or len(raw) != length:
        return (f"loss_mask length {len(raw) if isinstance(raw, (list, tuple)) else '?'}"
                f" differs from input_ids length {length}")
    for n, x in enumerate(raw):
        if not (isinstance(x, (int, bool)) and x in (0, 1)):
            return f"loss_mask[{n}] is {x!r}: expected 0 or 1 (integers or booleans)"
    return np.asarray(raw, dtype=np.uint8)


def row_to_sample(index: int, row: Any, vocab_size: int,
                  tokenizer: Callable[[], Any], loss_mask: str = "assistant") -> Sample | BadRow:
    """Validate one row. `tokenizer` is called only for raw chats (loading it is not free);
    `loss_mask` is the mode for raw chats (rows with their own loss_mask keep it)."""
    if isinstance(row, BadRow):
        return row
    if not isinstance(row, dict):
        return BadRow(index, "row is not an object")
    chat = None
    try:
        if row.get("input_ids") is not None:
            raw = row["input_ids"]
            if not isinstance(raw, (list, tuple)) or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in raw):
                return BadRow(index, "input_ids is not a list of integers")
            ids = np.asarray(raw, dtype=np.int64)
            if row.get("loss_mask") is not None:
                mask = _mask_from_row(row["loss_mask"], len(raw))
                if isinstance(mask, str):
                    return BadRow(index, mask)
            else:
                mask = np.ones(len(ids), dtype=np.uint8)
        elif "conversations" in row or "messages" in row:
            chat = _chat_messages(row)
            ids, mask = tokenize_chat(chat, tokenizer(), loss_mask)
        else:
            return BadRow(index, "row has none of input_ids, conversations, messages")
    except (ValueError, TypeError, OverflowError) as e:
        return BadRow(index, f"malformed row: {e}")
    if len(ids) == 0:
        return BadRow(index, "no tokens")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return BadRow(index, f"token id {bad} out of range for vocab size {vocab_size}")
    return Sample(index, ids, mask, chat)
