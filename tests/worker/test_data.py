"""The loss mask the trainers agree with: each assistant turn from the end of the generation prompt
through its end-of-turn token, found through the chat template itself, on three kinds of template."""

from __future__ import annotations

import json

import numpy as np
import pytest

from worker.data import BadRow, DataError, row_to_sample, tokenize_chat
from tests.conftest import read_events, run_worker

# Qwen3's rule, cut down: an assistant turn after the last user message gets an (empty) think block
# when it is the last message; earlier turns are rendered without one.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_query and loop.last -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
# Llama-3's template: it trims every message.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a hidden state"},
        {"role": "assistant", "content": "the output of one layer"},
        {"role": "user", "content": "and the norm"},
        {"role": "assistant", "content": "it scales each token"}]


@pytest.fixture(scope="module")
def tokenizers(dense_model):
    from transformers import AutoTokenizer
    chatml = AutoTokenizer.from_pretrained(dense_model)
    qwen3 = AutoTokenizer.from_pretrained(dense_model)
    qwen3.add_tokens(["<think>", "</think>"])              # plain added tokens, as in Qwen3
    qwen3.chat_template = QWEN3_TEMPLATE
    llama3 = AutoTokenizer.from_pretrained(dense_model)
    llama3.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens":
                               ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    llama3.chat_template = LLAMA3_TEMPLATE
    return {"chatml": chatml, "qwen3": qwen3, "llama3": llama3}


def supervised_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The supervised token ids, one list per contiguous run."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name, expected", [
    ("chatml", ["the output of one layer<|im_end|>", "it scales each token<|im_end|>"]),
    # the empty think block the template inserts into the last turn is the model's output too
    ("qwen3", ["the output of one layer<|im_end|>", "<think>\n\n</think>\n\nit scales each token<|im_end|>"]),
    ("llama3", ["the output of one layer<|eot_id|>", "it scales each token<|eot_id|>"]),
])
def test_each_assistant_turn_through_its_end_of_turn_token(tokenizers, name, expected):
    tok = tokenizers[name]
    ids, mask = tokenize_chat(CHAT, tok, "assistant")
    assert ids.tolist() == encode(tok, tok.apply_chat_template(CHAT, tokenize=False))
    assert supervised_runs(ids, mask) == [encode(tok, text) for text in expected]


def test_trimming_template_keeps_supervision_of_padded_turns(tokenizers):
    """Llama-3 trims each message: a turn with spaces around it is not found as text, so the
    old mask lost it; the rendering-based mask does not."""
    tok = tokenizers["llama3"]
    chat = [{"role": "user", "content": "  hello  "}, {"role": "assistant", "content": "  the answer is two  "},
            {"role": "user", "content": "why"}, {"role": "assistant", "content": " because\n"}]
    ids, mask = tokenize_chat(chat, tok, "assistant")
    assert supervised_runs(ids, mask) == [encode(tok, "the answer is two<|eot_id|>"),
                                          encode(tok, "because<|eot_id|>")]
    _, old = tokenize_chat(chat, tok, "assistant-content")
    assert old.sum() == 0                                  # what the message-text search gave


def test_assistant_content_and_all_modes(tokenizers):
    tok = tokenizers["qwen3"]
    ids, mask = tokenize_chat(CHAT, tok, "assistant-content")
    assert supervised_runs(ids, mask) == [encode(tok, "the output of one layer"),
                                          encode(tok, "it scales each token")]
    ids, mask = tokenize_chat(CHAT, tok, "all")
    assert mask.tolist() == [1] * len(ids)


def test_template_without_generation_prompt_is_refused_with_a_way_out(tokenizers):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizers["chatml"].name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(DataError, match="no generation prompt.*assistant-content"):
        tokenize_chat(CHAT, tok, "assistant")


@pytest.mark.parametrize("mask, reason", [
    (["0", "0", "1"], "loss_mask[0] is '0': expected 0 or 1"),
    ([0, 2, 1], "loss_mask[1] is 2"),
    ([0, 1.0, 1], "loss_mask[1] is 1.0"),
    ([0, 1], "loss_mask length 2 differs from input_ids length 3"),
])
def test_row_loss_mask_only_zero_or_one(mask, reason):
    bad = row_to_sample(7, {"input_ids": [1, 2, 3], "loss_mask": mask}, 100, lambda: None)
    assert isinstance(bad, BadRow) and bad.index == 7 and reason in bad.reason


def test_row_loss_mask_accepts_ints_and_bools():
    sample = row_to_sample(0, {"input_ids": [1, 2, 3], "loss_mask": [False, 1, True]}, 100, lambda: None)
    assert sample.loss_mask.tolist() == [0, 1, 1]


def test_worker_masks_chats_and_skips_unsupervised_samples(tmp_path, dense_model, tokenizers):
    """Through the real worker: the default mask on a chat row, a string mask refused, and a row
    that supervises nothing recorded as skipped with that reason."""
    from worker.verify import verify
    from safetensors.torch import load_file
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": CHAT},
            {"input_ids": [5, 6, 7], "loss_mask": ["0", "0", "1"]},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]},
            {"conversations": [{"from": "human", "value": "hi"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, state = str(tmp_path / "out"), str(tmp_path / "st")
    r = run_worker("--max-skip-fraction", "1", "--model", dense_model, "--data", str(data), "--out", out, "--state", state)
    assert r.returncode == 0, r.stderr
    tok = tokenizers["chatml"]
    t = load_file(f"{out}/hs_0.safetensors")
    assert supervised_runs(t["token_ids"].numpy(), t["loss_mask"].numpy()) == [
        encode(tok, "the output of one layer<|im_end|>"), encode(tok, "it scales each token<|im_end|>")]
    skipped = {e["index"]: e["reason"] for e in read_events(state) if e["event"] == "sample_skipped"}
    assert skipped == {1: "loss_mask[0] is '0': expected 0 or 1 (integers or booleans)",
                       2: "no supervised token (loss_mask is all 0)",
                       3: "no supervised token (loss_mask is all 0)"}
    meta = json.load(open(f"{out}/meta.json"))
    assert meta["loss_mask"] == "assistant" and "end-of-turn token" in meta["loss_mask_convention"]
    assert verify(out)["problems"] == []
