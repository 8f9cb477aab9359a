"""--speculative-config (vLLM's JSON): n-gram parsed with vLLM's defaults, other methods and unknown keys
refused by name; `pagedserve serve` takes it and forwards it to the scheduler (and LLM's keyword reaches it);
refused with --batch-invariant. Argv only: no server."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve import launcher
from pagedserve.cli import parse_args
from pagedserve.launcher import _scheduler_argv
from pagedserve.private_server import server_argv
from scheduler_svc.config import scheduler_config_from_args
from scheduler_svc.main import add_arguments as add_scheduler_arguments
from scheduler_svc.core.speculative_config import SpeculativeConfig, speculative_config


def test_ngram_takes_vllms_defaults_and_one_lookup_bound_sets_the_other():
    config = speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min, config.num_speculative_tokens) == (5, 5, 3)
    assert config.disable_by_batch_size == 8
    config = speculative_config('{"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert (config.method, config.prompt_lookup_max, config.prompt_lookup_min) == ("ngram", 4, 4)
    config = speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (2, 2)
    config = speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 1, "disable_by_batch_size": 2}')
    assert config == SpeculativeConfig(4, 4, 1, 2)
    assert speculative_config(config.to_json()) == config


@pytest.mark.parametrize("text, message", [
    ('{"method": "medusa", "num_speculative_tokens": 3, "model": "x"}', "'medusa': needs heads"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method eagle needs model"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
     "unsupported key.s. prompt_lookup_max for method eagle"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "method eagle3 needs model"),
    ('{"method": "eagle3", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}',
     "unsupported key.s. draft_tensor_parallel_size for method eagle3"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "'mtp': needs heads"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "draft_model needs model"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
     "unsupported key.s. prompt_lookup_max for method draft_model"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": "2"}',
     "draft_tensor_parallel_size must be an integer"),
    ('{"method": "magic", "num_speculative_tokens": 1}', "'magic': unknown"),
    ('{"num_speculative_tokens": 3}', "method is required"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x", "draft_tensor_parallel_size": 1}',
     "unsupported key.s. draft_tensor_parallel_size, model"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must lie in \[1, 16\]"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', r"num_speculative_tokens must lie in \[1, 16\]"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min must be >= 1 and <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('[1]', "must be a JSON object"),
    ('{', "not JSON"),
])
def test_other_methods_unknown_keys_and_bad_values_are_refused_naming_them(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        speculative_config(text)


def test_draft_model_takes_its_model_and_a_config_with_a_model_and_no_method_is_one():
    config = speculative_config('{"method": "draft_model", "model": "/d", "num_speculative_tokens": 4, '
                                '"draft_tensor_parallel_size": 2}')
    assert (config.uses_draft_model, config.model, config.num_speculative_tokens) == (True, "/d", 4)
    assert config.disable_by_batch_size == 8 and speculative_config(config.to_json()) == config
    assert config.tensor_parallel_refusal(2) is None
    assert "draft_tensor_parallel_size 2" in config.tensor_parallel_refusal(1)
    assert speculative_config('{"model": "/d", "num_speculative_tokens": 2}').uses_draft_model
    eagle3 = speculative_config('{"method": "eagle3", "model": "/h", "num_speculative_tokens": 3}')
    assert (eagle3.method, eagle3.uses_draft_model, eagle3.model) == ("eagle3", True, "/h")
    assert speculative_config(eagle3.to_json()) == eagle3  # the scheduler child's flag gives it back
    eagle = speculative_config('{"method": "eagle", "model": "/h", "num_speculative_tokens": 2, '
                               '"disable_by_batch_size": 4}')
    assert (eagle.method, eagle.uses_draft_model, eagle.model, eagle.disable_by_batch_size) == ("eagle", True, "/h", 4)
    assert speculative_config(eagle.to_json()) == eagle
    assert not speculative_config('{"method": "ngram", "num_speculative_tokens": 2}').uses_draft_model


SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


def test_serve_accepts_it_and_forwards_it_to_the_scheduler():
    args = parse_args(["serve", "--speculative-config", SPEC])
    argv = _scheduler_argv(args, [], "ipc:///tmp/x")
    forwarded = json.loads(argv[argv.index("--speculative-config") + 1])
    assert forwarded["num_speculative_tokens"] == 3 and forwarded["prompt_lookup_min"] == 1
    assert "--speculative-config" not in _scheduler_argv(parse_args(["serve"]), [], "ipc:///tmp/x")
    parser = argparse.ArgumentParser()
    add_scheduler_arguments(parser)
    config = scheduler_config_from_args(parser.parse_args(argv))
    assert config.speculative_config == SpeculativeConfig(3, 4, 1)


def test_llm_keyword_becomes_the_flag():
    argv = server_argv(None, {"speculative_config": json.loads(SPEC)})
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == json.loads(SPEC)


def test_serve_refuses_it_with_batch_invariant(monkeypatch):
    args = parse_args(["serve", "--speculative-config", SPEC, "--batch-invariant"])
    monkeypatch.setattr(launcher, "resolve_servable_model", lambda args: pytest.fail("checked after the model"))
    with pytest.raises(SystemExit, match="--speculative-config cannot go with --batch-invariant"):
        launcher.serve(args)


def test_serve_resolves_the_draft_model_once_and_refuses_one_the_workers_would_refuse(tmp_path):
    """The draft's path reaches the scheduler resolved; a smaller vocabulary or context, heads that do not split
    over the ranks, another draft_tensor_parallel_size, or no checkpoint at all exit naming why, before any child."""
    from pagedserve.testing.tiny_models import make_tiny_model

    target = make_tiny_model(tmp_path, "llama", seed=1)
    draft = make_tiny_model(tmp_path, "qwen2", seed=2, num_hidden_layers=1)

    def serve_args(draft_dir, *flags, **options):
        spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2, **options}
        return parse_args(["serve", "--model", str(target), "--speculative-config", json.dumps(spec), *flags])

    args = serve_args(tmp_path / ".." / tmp_path.name / draft.name)
    launcher.resolve_draft_model(args, str(target))
    argv = _scheduler_argv(args, [], "ipc:///tmp/x")
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == str(draft)
    small = make_tiny_model(tmp_path, "qwen2", seed=2, vocab_size=256)
    three_heads = make_tiny_model(tmp_path, "qwen2", seed=2, num_attention_heads=3, num_key_value_heads=1,
                                  hidden_size=48)
    short = make_tiny_model(tmp_path, "qwen2", seed=2, max_position_embeddings=64)
    for args, words in ((serve_args(small), r"vocabulary \(256 ids\) is smaller than the target.s \(512\)"),
                        (serve_args(short, "--max-model-len", "128"), r"context \(64 tokens\) is shorter than the "
                                                                       r"served 128: lower --max-model-len"),
                        (serve_args(three_heads, "-tp", "2"), "the draft model: --tensor-parallel-size 2"),
                        (serve_args(draft, draft_tensor_parallel_size=2), "draft_tensor_parallel_size 2"),
                        (serve_args(tmp_path / "nothing"), "cannot serve the draft model")):
        with pytest.raises(SystemExit, match=words):
            launcher.resolve_draft_model(args, str(target))


def test_a_standalone_scheduler_refuses_a_draft_tensor_parallel_size_other_than_its_workers():
    spec = json.dumps({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2,
                       "draft_tensor_parallel_size": 2})
    parser = argparse.ArgumentParser()
    add_scheduler_arguments(parser)
    assert scheduler_config_from_args(parser.parse_args(["--speculative-config", spec, "--num-workers", "2"]))
    with pytest.raises(SystemExit, match="draft_tensor_parallel_size 2"):
        scheduler_config_from_args(parser.parse_args(["--speculative-config", spec]))
