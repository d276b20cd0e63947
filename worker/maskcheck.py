"""A checked row's loss mask against the chat template's own rendering (issue 36): the rows the
reference forward re-computes have their mask, as written, compared with what the template says,
so a template change (or a writer bug) cannot silently shift what the drafter is trained on.

worker.data derives an `assistant` mask by locating each turn between renderings (the conversation
before it with the generation prompt, the turn rendered last); this check does not repeat that. It
reads the full rendering once and finds each message's own text in it, in order, and asks what any
right mask must satisfy:

- the written tokens are the template's rendering of the row now (truncated rows: its first tokens);
- each assistant message's text (after a `</think>`, which templates split off) is supervised;
- no user, system or tool message's text is;
- the supervised count lies between the assistant texts' tokens and, per turn, the turn as the
  template renders it when it is the last (generation prompt excluded; a template renders an
  earlier turn the same or shorter: Qwen3 drops its thinking), give or take SLACK tokens a turn
  (tokens that straddle its ends) — the counts go in the check's line.

"Supervised" is by majority: a token straddling a boundary counts with whichever side holds most
of it; a text of fewer than JUDGED tokens is counted but not judged (a one-word message can be
found in the template's own words: "user" in a header). `all` masks must be all ones. Rows that came with their own loss_mask are not checked (no
template made them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import _render, common_prefix

JUDGED = 3                       # a message's text needs this many tokens to be judged
SLACK = 4                        # tokens a turn may gain in context (a token across its start or end)


@dataclass
class MaskCheck:
    """What the check found for one row: the figures for its line, and the problem, if any."""
    supervised: int
    content: int                 # tokens of the assistant texts found in the rendering
    most: int                    # the turns rendered each as the last, summed
    problem: str | None = None

    def line(self) -> dict:
        return {"supervised": self.supervised, "content": self.content, "most": self.most}


def check_mask(messages: list[dict], ids: np.ndarray, mask: np.ndarray, tokenizer: Any,
               mode: str) -> MaskCheck:
    """The written (`ids`, `mask`) of a raw chat row against the template's rendering of `messages`."""
    ids, mask = np.asarray(ids).reshape(-1), np.asarray(mask).reshape(-1)
    supervised = int(mask.sum())
    text = _render(tokenizer, messages, False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    now = np.asarray(enc["input_ids"], dtype=np.int64)
    if problem := _not_the_rendering(ids, now):
        return MaskCheck(supervised, 0, 0, problem)
    offsets = [tuple(o) for o in enc["offset_mapping"][:len(ids)]]
    if mode == "all":
        return MaskCheck(supervised, len(ids), len(ids),
                         None if supervised == len(ids) else f"loss_mask = \"all\" but {len(ids) - supervised} "
                                                             f"of its {len(ids)} tokens are not supervised")
    content, problem = _judge_texts(messages, text, tokenizer, mode, offsets, mask)
    most = _most(messages, tokenizer) if mode == "assistant" else content
    turns = sum(1 for m in messages if m["role"] == "assistant")
    problem = problem or _count_problem(supervised, content, most, turns, truncated=len(ids) < len(now))
    return MaskCheck(supervised, content, most, problem)


def _not_the_rendering(ids: np.ndarray, now: np.ndarray) -> str | None:
    """Why the written tokens are not the template's rendering of the row now (or its first
    tokens, for a truncated row); None when they are."""
    if len(ids) <= len(now) and np.array_equal(now[:len(ids)], ids):
        return None
    at = next((t for t in range(min(len(ids), len(now))) if now[t] != ids[t]), min(len(ids), len(now)))
    return (f"its tokens are not the chat template's rendering of the row (they differ from token {at}): "
            f"the template or tokenizer changed?")


def _judge_texts(messages: list[dict], text: str, tokenizer: Any, mode: str, offsets: list[tuple],
                 mask: np.ndarray) -> tuple[int, str | None]:
    """The tokens of the assistant texts found in the rendering, and the first message whose text
    is on the wrong side of the mask (`_text_problem`), of those long enough to judge."""
    content, problem = 0, None
    for role, n, (a, b) in _spans(messages, text, tokenizer, split_thinking=mode == "assistant"):
        inside = [t for t, (s, e) in enumerate(offsets) if _mostly_within(s, e, a, b)]
        if not inside:
            continue                                    # cut off by truncation, or all whitespace
        if role == "assistant":
            content += len(inside)
        if len(inside) >= JUDGED and problem is None:
            problem = _text_problem(role, n, int(mask[inside].sum()), inside)
    return content, problem


def _text_problem(role: str, n: int, held: int, inside: list[int]) -> str | None:
    """Turn n's text (its tokens `inside`, `held` of them supervised) on the wrong side of the
    mask, by majority: an assistant's not supervised, or anyone else's supervised."""
    if role == "assistant" and held * 2 < len(inside):
        return (f"assistant turn {n}'s text is not supervised ({held} of its {len(inside)} tokens, "
                f"from token {inside[0]}) in the chat template's rendering")
    if role != "assistant" and held * 2 > len(inside):
        return (f"{role} turn {n}'s text is supervised ({held} of its {len(inside)} tokens, from token "
                f"{inside[0]}): the mask is not on the assistant turns of the template's rendering")
    return None


def _count_problem(supervised: int, content: int, most: int, turns: int, truncated: bool) -> str | None:
    """The supervised count outside its bounds: more than the `turns` assistant turns make as the
    template renders them (`most`, give or take SLACK a turn; a truncated row is not judged so),
    or fewer than half the assistant texts' tokens (`content`)."""
    if supervised > most + SLACK * turns and not truncated:
        return (f"{supervised} tokens supervised, more than its {turns} assistant turn(s) make as the "
                f"template renders them ({most})")
    if content and supervised < content // 2:
        return f"{supervised} tokens supervised, fewer than its assistant turns' text ({content})"
    return None


def _spans(messages: list[dict], text: str, tokenizer: Any,
           split_thinking: bool) -> list[tuple[str, int, tuple[int, int]]]:
    """(role, turn number, character span) of each message's own text found in the rendering, in
    order. With `split_thinking` (`assistant` masks) each is searched for from where its header ends
    (`_body_start`), stripped, an assistant message's text after its last `</think>` (templates
    render the thinking apart, or drop it); else as `assistant-content` masks are defined: each
    text whole, as given, from where the one before it ends. A text not found (a template that
    rewrites it) is left out."""
    out, pos = [], 0
    for n, m in enumerate(messages):
        body = m.get("content") or ""
        if split_thinking:
            body = (body.split("</think>")[-1] if m["role"] == "assistant" else body).strip()
            at = text.find(body, _body_start(messages, n, text, tokenizer, pos)) if body else -1
        else:
            at = text.find(body, pos) if body else -1
        if at < 0:
            continue
        out.append((m["role"], n, (at, at + len(body))))
        pos = at + len(body)
    return out


def _body_start(messages: list[dict], n: int, text: str, tokenizer: Any, pos: int) -> int:
    """Where message n's text can begin in the rendering: past the conversation before it and its
    own header, found by rendering it with empty text (where that rendering stops matching); at
    least `pos` (the end of the text found before it). A one-word message is then not found in a
    header ("user")."""
    try:
        probe = _render(tokenizer, messages[:n] + [{**messages[n], "content": ""}], False)
    except Exception:                   # a template that refuses an empty message: what is known
        return pos
    return max(pos, common_prefix(probe, text, tokenizer))


def _mostly_within(s: int, e: int, a: int, b: int) -> bool:
    """Whether the token of characters [s, e) lies mostly inside [a, b)."""
    return e > s and (min(e, b) - max(s, a)) * 2 > (e - s)


def _most(messages: list[dict], tokenizer: Any) -> int:
    """Tokens of each assistant turn as the template renders it when it is the last message, from
    where the conversation before it with the generation prompt stops, trailing whitespace left out."""
    total = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        own = _render(tokenizer, messages[: i + 1], False)
        try:
            before = _render(tokenizer, messages[:i], True)
        except (ValueError, IndexError, TypeError):      # a template that cannot render nothing
            before = ""
        turn = own[common_prefix(before, own, tokenizer):].rstrip()
        total += len(tokenizer(turn, add_special_tokens=False)["input_ids"])
    return total
