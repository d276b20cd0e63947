"""The loss mask the trainers agree with: each assistant turn from the end of the generation prompt
through its end-of-turn token, found through the chat template itself, on three kinds of template."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from worker.data import BadRow, DataError, _chat_messages, row_to_sample, tokenize_chat
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


# --- real chat templates (written into tests/worker/chat_templates: no hub access in CI) -----------

TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")
TOOL_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny"},
             {"role": "assistant", "content": "It is sunny.", "reasoning_content": "the tool said sunny"}]
THINK_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nhello"},
              {"role": "user", "content": "bye"}, {"role": "assistant", "content": "<think>\nsay bye\n</think>\n\ngoodbye"}]
FIRST_CHAT = [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"},
              {"role": "assistant", "content": "done"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def real(dense_model):
    from transformers import AutoTokenizer
    out = {}
    for name in ("qwen3", "qwen3_thinking_2507", "qwq", "llama3_3"):
        tok = AutoTokenizer.from_pretrained(dense_model)
        if name.startswith("llama"):
            tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens":
                                    ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
        else:                                   # plain added tokens, as in the Qwen tokenizers
            tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                            "</tool_response>"])
        tok.chat_template = open(os.path.join(TEMPLATES, f"{name}.jinja")).read()
        out[name] = tok
    return out


# By hand, per template: what the model generates in each assistant turn, end-of-turn token included;
# a think block the generation prompt opens (Qwen3-Thinking-2507, QwQ) is the prompt's, not the turn's.
EXPECTED = {
    ("qwen3", "tools"): [CALL, "<think>\nthe tool said sunny\n</think>\n\nIt is sunny.<|im_end|>"],
    ("qwen3", "think"): ["hello<|im_end|>", "<think>\nsay bye\n</think>\n\ngoodbye<|im_end|>"],
    ("qwen3", "first"): ["I start<|im_end|>", "<think>\n\n</think>\n\ndone<|im_end|>"],
    ("qwen3_thinking_2507", "tools"): [CALL, "the tool said sunny\n</think>\n\nIt is sunny.<|im_end|>"],
    ("qwen3_thinking_2507", "think"): ["hello<|im_end|>", "say bye\n</think>\n\ngoodbye<|im_end|>"],
    ("qwen3_thinking_2507", "first"): ["I start<|im_end|>", "\n</think>\n\ndone<|im_end|>"],
    ("qwq", "tools"): [CALL, "It is sunny.<|im_end|>"],                    # QwQ drops reasoning_content
    ("qwq", "think"): ["hello<|im_end|>", "goodbye<|im_end|>"],            # and the thinking of every turn
    ("qwq", "first"): ["I start<|im_end|>", "done<|im_end|>"],
    ("llama3_3", "tools"): ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                            "It is sunny.<|eot_id|>"],
    ("llama3_3", "think"): ["<think>\nsay hi\n</think>\n\nhello<|eot_id|>",
                            "<think>\nsay bye\n</think>\n\ngoodbye<|eot_id|>"],
    # its default system block ("Cutting Knowledge Date ...") comes first and is not supervised
    ("llama3_3", "first"): ["I start<|eot_id|>", "done<|eot_id|>"],
}
CHATS = {"tools": TOOL_CHAT, "think": THINK_CHAT, "first": FIRST_CHAT}


@pytest.mark.parametrize("name, chat", list(EXPECTED))
def test_real_templates_mask_what_the_model_generates(real, name, chat):
    tok = real[name]
    sample = row_to_sample(0, {"messages": CHATS[chat]}, len(tok), lambda: tok)
    assert not isinstance(sample, BadRow), sample.reason
    text = tok.apply_chat_template(_chat_messages({"messages": CHATS[chat]}), tokenize=False)
    assert sample.input_ids.tolist() == encode(tok, text)      # (a tool call's None content is "")
    assert [tok.decode(r) for r in supervised_runs(sample.input_ids, sample.loss_mask)] == EXPECTED[name, chat]


def test_an_empty_turn_ends_at_its_own_end_of_turn_token(real):
    """Qwen3-Thinking-2507's prompt ends in `<think>`, an empty turn is only `<|im_end|>`: the two
    agree on the `<`, and the turn once started inside its end-of-turn token and ran on through the
    next user turn (found by worker/maskcheck.py's property test)."""
    tok = real["qwen3_thinking_2507"]
    chat = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "the the"}, {"role": "assistant", "content": ""}]
    sample = row_to_sample(0, {"messages": chat}, len(tok), lambda: tok)
    assert [tok.decode(r) for r in supervised_runs(sample.input_ids, sample.loss_mask)] == \
        ["<|im_end|>", "\n</think>\n\n<|im_end|>"]


def test_either_key_style_under_either_list_name(real):
    tok = real["qwen3"]
    styles = [{"conversations": [{"role": m["role"], "content": m["content"]} for m in THINK_CHAT]},
              {"messages": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                            for m in THINK_CHAT]},
              {"messages": THINK_CHAT}]
    samples = [row_to_sample(0, row, len(tok), lambda: tok) for row in styles]
    assert all(not isinstance(s, BadRow) for s in samples)
    assert all(s.input_ids.tolist() == samples[-1].input_ids.tolist() and
               s.loss_mask.tolist() == samples[-1].loss_mask.tolist() for s in samples)
    bad = row_to_sample(3, {"messages": [{"role": "robot", "content": "x"}]}, len(tok), lambda: tok)
    assert isinstance(bad, BadRow) and "turn 0 has unknown role 'robot'" in bad.reason


def test_worker_writes_every_tool_and_thinking_chat(tmp_path, dense_model):
    """Through the real worker, under the Qwen3 template (tools, reasoning_content): a tool dataset
    (which used to end FATAL: every row skipped) is written whole, and speculators' reader takes
    every row of the prepared dataset the worker wrote beside it."""
    from transformers import AutoTokenizer
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(dense_model):
        if not name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.symlink(os.path.join(dense_model, name), model / name)
    tok = AutoTokenizer.from_pretrained(dense_model)
    tok.chat_template = open(os.path.join(TEMPLATES, "qwen3.jinja")).read()
    tok.save_pretrained(str(model))
    rows = [{"messages": TOOL_CHAT}, {"conversations": THINK_CHAT}, {"messages": FIRST_CHAT},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "out")
    r = run_worker("--model", str(model), "--data", str(data), "--out", out)
    assert r.returncode == 0, r.stderr
    from worker.writer import load_finished
    assert sorted(i for i, rec in load_finished(out).items() if "skipped" not in rec) == [0, 1, 2, 3]
    speculators = pytest.importorskip("speculators.train.data")
    ds = speculators.ArrowDataset(max_len=4096, datapath=os.path.join(out, "prepared"), on_missing="raise")
    assert len(ds) == 4 and all(isinstance(ds[k], dict) and ds[k]["loss_mask"].sum() > 0 for k in range(4))
