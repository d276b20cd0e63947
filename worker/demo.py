"""Small, self-made test assets: a tokenizer trained here, tiny random-initialised models, and
synthetic chat datasets with ShareGPT-like lengths. Nothing is downloaded.

`python -m worker.demo --model DIR --data FILE` makes them if absent (what the local demo runs).
"""

from __future__ import annotations

import argparse
import json
import os
import random

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
_WORDS = ("the a model layer hidden state token batch shard fleet worker speculative decoding draft "
          "verify sample length budget attention gate delta memory write disk atomic rename resume "
          "python torch tensor kernel matrix norm embed output input question answer explain why how "
          "what when where please thanks hello world code function return value error test fast "
          "slow small large number one two three four five six seven eight nine ten").split()


def synthetic_text(rng: random.Random, words: int) -> str:
    out: list[str] = []
    for i in range(words):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice(".,?!:")
    return " ".join(out)


def sharegpt_lengths(rng: random.Random, n: int, mean: float) -> list[int]:
    """Lognormal lengths (sigma 0.9) scaled to the given mean: ShareGPT's long-tailed shape."""
    import math
    sigma = 0.9
    mu = math.log(mean) - sigma * sigma / 2
    return [max(8, int(rng.lognormvariate(mu, sigma))) for _ in range(n)]


def make_tokenizer(path: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on synthetic text, with a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [synthetic_text(rng, 60) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus + ["user assistant system \n"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def update_chat_template(path: str) -> None:
    """Demo models made before the template had a generation prompt get the current one. Read
    from the saved files first: importing transformers to find it current was 2.5 s of each demo."""
    if saved_template(path) == CHAT_TEMPLATE:
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.chat_template != CHAT_TEMPLATE:
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(path)


def saved_template(path: str) -> str | None:
    """The chat template a tokenizer folder holds (its chat_template.jinja, else its config's)."""
    try:
        with open(os.path.join(path, "chat_template.jinja")) as f:
            return f.read()
    except OSError:
        pass
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None


def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 8):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=False)
    if arch == "qwen3":
        return AutoConfig.for_model("qwen3", **common)
    if arch == "qwen3_5_text":
        types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
        return AutoConfig.for_model("qwen3_5_text", layer_types=types, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=hidden // 4,
                                    linear_value_head_dim=hidden // 4, **common)
    raise ValueError(f"unknown demo architecture {arch!r}")


def make_model(path: str, arch: str = "qwen3", hidden: int = 64, layers: int = 8, seed: int = 0) -> str:
    """A random-initialised causal LM saved with save_pretrained, with the local tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), hidden, layers))
    model.save_pretrained(path)
    return path


def make_chat_dataset(path: str, n: int, mean_words: float = 60, seed: int = 0,
                      form: str = "sharegpt") -> str:
    """Raw multi-turn chats, ShareGPT (`conversations`) or OpenAI (`messages`) form, one a line."""
    rng = random.Random(seed)
    lengths = sharegpt_lengths(rng, n, mean_words)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for total in lengths:
            turns = []
            for t in range(rng.choice((2, 2, 4))):
                words = max(2, total // 4 if t % 2 == 0 else total // 2)
                turns.append((("human", "user") if t % 2 == 0 else ("gpt", "assistant"),
                              synthetic_text(rng, words)))
            if form == "sharegpt":
                row = {"conversations": [{"from": r[0], "value": text} for r, text in turns]}
            else:
                row = {"messages": [{"role": r[1], "content": text} for r, text in turns]}
            f.write(json.dumps(row) + "\n")
    return path


def make_token_dataset(path: str, n: int, vocab_size: int, mean_tokens: float = 728,
                       seed: int = 0, max_tokens: int | None = None) -> str:
    """Pre-tokenized rows (input_ids + loss_mask) with ShareGPT-like lengths."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for length in sharegpt_lengths(rng, n, mean_tokens):
            if max_tokens:
                length = min(length, max_tokens)
            ids = [rng.randrange(vocab_size) for _ in range(length)]
            cut = length // 3
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * cut + [1] * (length - cut)}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m worker.demo",
                                description="Make the local demo's tiny model and chat dataset if absent.")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        make_model(args.model, hidden=args.hidden, layers=args.layers)
        print(f"made demo model {args.model}")
    else:
        update_chat_template(args.model)
    if not os.path.exists(args.data):
        make_chat_dataset(args.data, args.samples)
        print(f"made demo dataset {args.data}")


if __name__ == "__main__":
    main()
