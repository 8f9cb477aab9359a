"""Tiny tokenizer files for tests: an OPT-style byte-level BPE (vocab.json + merges.txt, no tokenizer.json).

Why trained here: facebook/opt-* repositories ship only these two files and the configs, and tests may not
download; a BPE trained in milliseconds on a few sentences has the same file format, special tokens at the same
ids (<s> 0, <pad> 1, </s> 2, <unk> 3) and the same tokenizer_config.json as opt-125m's.
"""

from __future__ import annotations

import json
from pathlib import Path

OPT_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
TRAINING_TEXT = [
    "Hello, my name is Ada. The president of the United States is a person. The capital of France is Paris.",
    "The future of AI is bright; tokenizers split text into pieces, byte by byte: café, naïve, 日本語, emoji 🙂.",
    "def f(x):\n    return x * 2  # twice\n\tTabs and  double  spaces, numbers 12345 and 3.14159.",
]
OPT_TOKENIZER_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "add_prefix_space": False, "errors": "replace",
    "bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>",
    "model_max_length": 1000000000000000019884624838656,
}


def write_opt_tokenizer(directory: str | Path, vocab_size: int = 400) -> Path:
    """vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json as opt-125m has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=OPT_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    tokenizer.model.save(str(directory))
    (directory / "tokenizer_config.json").write_text(json.dumps(OPT_TOKENIZER_CONFIG))
    special = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special))
    return directory
