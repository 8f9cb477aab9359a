"""A tokenizer for a model of random weights: one word per token id, written beside its config.json.

Why: a benchmark shape (benchmarks/model_shapes.py) or a tiny test model has no tokenizer, yet the tutorial's
experiment talks to both servers in text over the OpenAI API. A real tokenizer would not do: a model of random
weights picks any id of its vocabulary (151,936 for Qwen2.5), and ids past a borrowed tokenizer's vocabulary
decode to nothing. Here id i is the word `w{i}` (0, 1 and 2 are <unk>, <s> and </s>, the ids model_shapes and
tiny_models give bos and eos), so every id decodes to text and the text encodes back to the same ids: both
servers count the same tokens, and a prompt of N words is N tokens (plus the chat template's). Words outside
the vocabulary are <unk>.

Write it into a directory of its own and pass it as --tokenizer: beside a config.json, transformers 5's
AutoTokenizer takes the tokenizer class of the config's model type (Qwen2Tokenizer for a Qwen2 shape), which
rebuilds a byte-level BPE from these files and turns every word into <unk> (pagedserve's own loader reads the
files as written, wherever they are).

The files are tokenizer.json (read by our scheduler and by transformers), tokenizer_config.json (the special
tokens and a plain chat template, so /v1/chat/completions works on both servers) and special_tokens_map.json.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word(token_id: int) -> str:
    return SPECIAL_TOKENS[token_id] if token_id < len(SPECIAL_TOKENS) else f"w{token_id}"


def write_id_word_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Writes the tokenizer files of a `vocab_size`-id word tokenizer into `directory` (a model directory)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 1 << 30, **special}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    return directory
