"""The offline `LLM` class: it starts its own server, generates for every prompt at once, and returns
results in prompt order equal to what a separately started server answers for the same greedy requests;
`chat` renders conversations with the model's template; max_tokens 0 scores the prompt and samples nothing;
server options are checked against the real CLI."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.private_server import server_argv
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

SERVER_OPTIONS = dict(max_model_len=128, num_kv_blocks=96)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=str(model_dir), **SERVER_OPTIONS) as offline:
        yield offline


def test_generate_returns_one_result_per_prompt_in_order_equal_to_the_servers_greedy_answers(llm, model_dir, tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    lengths = [rng.randrange(1, 24) for _ in prompts]  # different lengths: finishing order is not prompt order
    params = [SamplingParams(temperature=0.0, max_tokens=length) for length in lengths]
    results = llm.generate(prompts, params, use_tqdm=False)

    assert len(results) == 20
    with running_server(tmp_path, "--model", str(model_dir), "--max-model-len", "128", "--num-kv-blocks", "96") as server:
        with server.client() as client:
            expected = [client.generate(prompt, temperature=0.0, max_tokens=length) for prompt, length in zip(prompts, lengths)]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.prompt_tokens for r in results] == [len(p) for p in prompts]
    assert [len(r.token_ids) for r in results] == lengths


def test_one_sampling_params_applies_to_every_prompt_and_n_returns_n_outputs(llm):
    results = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=5),
                           use_tqdm=False)
    assert [len(result.outputs) for result in results] == [3, 3]
    assert all(len(output.token_ids) == 5 for result in results for output in result.outputs)
    again = llm.generate([5, 6, 7], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=5))  # with a progress bar
    assert [o.token_ids for o in again[0].outputs] == [o.token_ids for o in results[0].outputs]  # seeded


def test_vllms_prompt_dicts_are_the_prompts_they_hold(llm):
    """{"prompt_token_ids": ids} (vLLM's TokensPrompt), alone or among other forms, generates from those ids,
    not from the text of the key; a dict with anything else is refused naming the key."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    plain = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    as_dicts = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [8, 9]], params, use_tqdm=False)
    single = llm.generate({"prompt_token_ids": (8, 9)}, params, use_tqdm=False)
    assert [r.token_ids for r in as_dicts] == [r.token_ids for r in plain]
    assert single[0].token_ids == plain[1].token_ids and single[0].prompt_tokens == 2
    for bad, message in [({"prompt_token_ids": [5], "multi_modal_data": {}}, "multi_modal_data"),
                         ({"prompt": [5, 6]}, "prompt_token_ids"), ({}, "exactly one"), (3.5, "float")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([bad], params, use_tqdm=False)


def test_results_carry_vllms_request_output_fields(llm, capsys):
    """prompt_token_ids (None text for an ids prompt, as vLLM's), finished, and the client's metrics in time
    order; the progress bar reports vLLM's token speeds."""
    results = llm.generate([[5, 6, 7], {"prompt_token_ids": [9, 10]}], SamplingParams(temperature=0.0, max_tokens=4))
    assert [r.prompt_token_ids for r in results] == [(5, 6, 7), (9, 10)]
    assert [r.prompt for r in results] == [None, None]
    for result in results:
        assert result.finished
        metrics = result.metrics
        assert metrics.arrival_time <= metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    progress = capsys.readouterr().err
    assert "Processed prompts" in progress and "est. speed input:" in progress and "output:" in progress


def test_beam_search_returns_the_servers_beams_with_the_prompt_best_first(llm):
    from pagedserve import BeamSearchParams

    outputs = llm.beam_search([[5, 6, 7], {"prompt_token_ids": [8, 9]}], BeamSearchParams(beam_width=3, max_tokens=5))
    from client import Client

    with Client(llm.target) as client:
        direct = client.generate([5, 6, 7], beam_width=3, n=3, max_tokens=5, temperature=0.0)
    assert len(outputs) == 2 and all(len(output.sequences) == 3 for output in outputs)
    assert [s.tokens for s in outputs[0].sequences] == [(5, 6, 7, *o.token_ids) for o in direct.outputs]
    assert [s.cum_logprob for s in outputs[0].sequences] == pytest.approx([o.cumulative_logprob for o in direct.outputs], abs=1e-3)
    assert all(s.tokens[:2] == (8, 9) for s in outputs[1].sequences)
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search([[5]], BeamSearchParams(beam_width=2, max_tokens=2, temperature=0.5))


def test_a_refused_prompt_raises_the_typed_error(llm):
    from client import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=2), use_tqdm=False)


def test_server_options_map_to_the_serve_flags_and_unknown_ones_fail_early():
    assert server_argv("m", dict(max_model_len=64, enable_prefix_caching=False, enable_chunked_prefill=True,
                                 preemption_mode="swap")) == [
        "--model", "m", "--max-model-len", "64", "--no-prefix-caching", "--preemption-mode", "swap"]
    with pytest.raises(TypeError, match="max_model_length"):
        server_argv(None, dict(max_model_length=64))
    with pytest.raises(TypeError, match="port"):
        server_argv(None, dict(port=1234))


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        LLM(model=str(tmp_path / "no-such-model"))


def test_chat_renders_each_conversation_with_the_template_in_order():
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name a color."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 2 + 2?"}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(max_model_len=512, cpu_kv_cache_space=0.1, swap_space=0.05) as smollm2:
        results = smollm2.chat(conversations, params, use_tqdm=False)
        single = smollm2.chat(conversations[0], params, use_tqdm=False)
        from client import Client

        with Client(smollm2.target) as client:
            expected = [client.generate(messages=conversation, temperature=0.0, max_tokens=12)
                        for conversation in conversations]
        text = smollm2.generate("The capital of France is", params, use_tqdm=False)[0]
        [continued] = smollm2.chat([{"role": "assistant", "content": "The capital of France is"}],
                                   SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False,
                                   add_generation_prompt=False, continue_final_message=True)
        tokenizer = smollm2.get_tokenizer()
    assert [r.text for r in results] == [e.text for e in expected]
    assert "Paris" in results[0].text
    assert [r.text for r in single] == [results[0].text]
    # vLLM's RequestOutput.prompt: the text as sent, or the conversation as its template rendered it.
    assert text.prompt == "The capital of France is"
    assert list(text.prompt_token_ids) == tokenizer.encode("The capital of France is")
    rendered = tokenizer.apply_chat_template(conversations[0], tokenize=False, add_generation_prompt=True)
    assert results[0].prompt == rendered and len(results[0].prompt_token_ids) == results[0].prompt_tokens
    assert continued.prompt.endswith("The capital of France is")  # vLLM's chat options reach the template


def test_each_output_carries_its_tokens_logprobs_streamed_or_ranked(llm):
    streamed, ranked = llm.generate([[5, 6, 7], [5, 6, 7]], [
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6),             # streamed token by token
        SamplingParams(n=2, best_of=4, temperature=0.8, seed=3, max_tokens=6),  # sent whole when ranked
    ], use_tqdm=False)
    for output in (*streamed.outputs, *ranked.outputs):
        assert len(output.logprobs) == len(output.token_ids) == 6
        assert all(logprob <= 0 for logprob in output.logprobs)
        assert sum(output.logprobs) == pytest.approx(output.cumulative_logprob, abs=1e-4)


def test_max_tokens_0_returns_the_prompt_logprobs_and_no_token(llm):
    [scored] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    [output] = scored.outputs
    assert output.token_ids == () and output.finish_reason == "length" and scored.completion_tokens == 0
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == 4
    assert all(entry.token.logprob <= 0 for entry in output.prompt_logprobs[1:])


def test_tensor_parallel_size_shards_the_offline_engine_with_the_same_greedy_tokens(llm, model_dir):
    """`LLM(tensor_parallel_size=2)`, vLLM's keyword: two gloo ranks behind the offline API answer what the
    one-rank engine answers."""
    prompts = [[5, 6, 7, 8], [9, 10, 300, 2, 41]]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(model=str(model_dir), tensor_parallel_size=2, **SERVER_OPTIONS) as sharded:
        on_two = sharded.generate(prompts, params, use_tqdm=False)
        log = sharded._log_tail()  # the server's log: its scheduler waited for two ranks
    assert "waiting for 2 worker(s)" in log
    assert [r.token_ids for r in on_two] == [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
