"""OPT end to end, as the documents this project starts from run it first (`LLM(model="facebook/opt-125m")` on
four prompts): a tiny random OPT with an opt-125m-style tokenizer (vocab.json + merges.txt, no tokenizer.json,
"</s>" prepended as BOS) answers text prompts through the processes and through the offline API with
transformers' greedy tokens and text; a chat request is refused (OPT has no chat template)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from client import InvalidRequestError
from pagedserve import LLM, SamplingParams
from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    return write_opt_tokenizer(make_tiny_model(tmp_path_factory.mktemp("models"), "opt", seed=1))


@pytest.fixture(scope="module")
def expected(opt_dir):
    """(prompt ids with the BOS, transformers' greedy ids, their text) per prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(opt_dir)
    answers = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert ids[0] == 2  # OPT's "</s>" BOS
        tokens = hf_greedy(opt_dir, ids, MAX_TOKENS)
        answers.append((ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True)))
    return answers


def test_text_prompts_through_the_processes_equal_transformers(opt_dir, expected, tmp_path):
    with running_server(tmp_path, "--model", str(opt_dir)) as server:
        def one(prompt):
            with server.client() as client:
                return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(one, PROMPTS))
        with server.client() as client, pytest.raises(InvalidRequestError, match="chat template"):
            client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    for result, (ids, tokens, text) in zip(results, expected):
        assert (result.prompt_tokens, list(result.token_ids), result.text) == (len(ids), tokens, text)


def test_the_tutorials_offline_example_equals_transformers(opt_dir, expected):
    with LLM(model=str(opt_dir)) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    for output, (ids, tokens, text) in zip(outputs, expected):
        assert output.prompt_tokens == len(ids)
        assert (list(output.outputs[0].token_ids), output.outputs[0].text) == (tokens, text)
