"""The loss mask of a checked row against the chat template's rendering (worker/maskcheck.py,
issue 36), on the real templates (Qwen3, Qwen3-Thinking-2507, QwQ, Llama-3.3).

Two computations meet here: worker.data's mask (each turn located between renderings) and the
check's reading of the one rendering (each message's text found in it). Over many chats drawn by
hypothesis — words that are the templates' own ("user", "assistant", "think"), thinking blocks,
empty turns — every mask the worker makes passes, in every mode; the same mask moved onto the turn
before, emptied, or one assistant turn's dropped, is named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.test_data import CHATS, real  # noqa: F401  (real: the templates' tokenizers)
from worker import inject
from worker.data import BadRow, row_to_sample
from worker.maskcheck import check_mask

TEMPLATES = ("qwen3", "qwen3_thinking_2507", "qwq", "llama3_3")
MODES = ("assistant", "assistant-content", "all")
WORDS = ["the", "user", "assistant", "system", "think", "layer", "norm", "hidden", "state", "a", "of", "token",
         "im_end", "<", ">", "\n", "Paris", "sunny", "42", "é", "…"]

text = st.lists(st.sampled_from(WORDS), min_size=0, max_size=14).map(" ".join)
reply = st.tuples(st.booleans(), text, text).map(
    lambda t: f"<think>\n{t[1]}\n</think>\n\n{t[2]}" if t[0] else t[2])
chats = st.tuples(st.one_of(st.none(), text), st.lists(st.tuples(text, reply), min_size=1, max_size=3)).map(
    lambda t: ([{"role": "system", "content": t[0]}] if t[0] is not None else [])
    + [m for u, a in t[1] for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})])


def sample_of(tok, messages, mode):
    sample = row_to_sample(0, {"messages": messages}, len(tok), lambda: tok, mode)
    return None if isinstance(sample, BadRow) else sample


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=chats, name=st.sampled_from(TEMPLATES), mode=st.sampled_from(MODES))
def test_every_mask_the_worker_makes_passes_the_check(real, messages, name, mode):  # noqa: F811
    tok = real[name]
    sample = sample_of(tok, messages, mode)
    if sample is None:
        return
    found = check_mask(sample.chat, sample.input_ids, sample.loss_mask, tok, mode)
    assert found.problem is None, (found, tok.apply_chat_template(messages, tokenize=False))
    assert found.supervised == int(sample.loss_mask.sum())


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("chat", list(CHATS))
def test_a_mask_off_the_assistant_turns_is_named(real, name, chat):  # noqa: F811
    tok = real[name]
    sample = sample_of(tok, CHATS[chat], "assistant")
    ids, mask = sample.input_ids, sample.loss_mask
    assert check_mask(sample.chat, ids, mask, tok, "assistant").problem is None
    early = check_mask(sample.chat, ids, inject.mask_early(mask), tok, "assistant").problem
    assert early is not None and ("turn" in early or "supervised" in early), early
    empty = check_mask(sample.chat, ids, np.zeros_like(mask), tok, "assistant").problem
    assert empty is not None
    whole = check_mask(sample.chat, ids, np.ones_like(mask), tok, "assistant").problem
    assert whole is not None and ("is supervised" in whole or "more than" in whole), whole


def test_a_row_rendered_by_another_template_is_named(real):  # noqa: F811
    """The tokens written are not what the template renders now: the template changed under the run."""
    sample = sample_of(real["qwen3"], CHATS["think"], "assistant")
    found = check_mask(sample.chat, sample.input_ids, sample.loss_mask, real["llama3_3"], "assistant")
    assert found.problem.startswith("its tokens are not the chat template's rendering of the row (they differ "
                                    "from token 0)"), found.problem


def test_a_truncated_row_is_checked_on_its_first_tokens(real):  # noqa: F811
    tok = real["qwen3"]
    sample = sample_of(tok, CHATS["tools"], "assistant")
    cut = len(sample.input_ids) - 3
    assert check_mask(sample.chat, sample.input_ids[:cut], sample.loss_mask[:cut], tok, "assistant").problem is None
    bad = inject.mask_early(sample.loss_mask)[:cut]
    assert check_mask(sample.chat, sample.input_ids[:cut], bad, tok, "assistant").problem is not None


def test_all_masks_must_be_all_ones(real):  # noqa: F811
    tok = real["llama3_3"]
    sample = sample_of(tok, CHATS["first"], "all")
    assert check_mask(sample.chat, sample.input_ids, sample.loss_mask, tok, "all").problem is None
    mask = sample.loss_mask.copy()
    mask[:4] = 0
    assert check_mask(sample.chat, sample.input_ids, mask, tok, "all").problem == \
        f'loss_mask = "all" but 4 of its {len(mask)} tokens are not supervised'
