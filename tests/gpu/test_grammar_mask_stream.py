"""A constrained row never samples a token its grammar masks out on a GPU, where the worker copies each step's
grammar bitmask to the device on a stream of its own beside the forward pass and the draw waits for that copy
(worker_svc/model_runner.py, `_apply_grammar_masks`): 256 rows for 48 steps, through `Worker.execute` alone.

Why this shape: the grammar `(a[0-9])+` allows "a" and the ten digits in turn, so each step's allowed set is
the one the step before disallowed, and a draw that read a mask still holding the last step's bits (a copy not
waited for) samples a rejected token; the logits favour 100 tokens the grammar never allows by +10 (logit_bias),
so a draw that read no mask, or a partly copied one, samples one of them. A vocabulary of 262,144 makes each
step's bitmask 8 MiB, a copy that takes a few hundred microseconds: without the wait the draw would start
while it still runs (the forward pass of the tiny model is done by then). Every row is checked by its text
against the regular expression, independently of llguidance, and the worker reports no grammar failure.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedserve.testing.tiny_models import make_tiny_model
from pagedserve.testing.tiny_tokenizers import OPT_SPECIAL_TOKENS, TRAINING_TEXT
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

GRAMMAR_REGEX = "(a[0-9])+"
OUTPUT = re.compile("(a[0-9])*a?")  # every prefix of the grammar's strings
VOCAB_SIZE = 262144
EOS = 2  # </s>
NUM_ROWS = 256
NUM_DECODE_STEPS = 48
PROMPT_LEN = 4
BLOCK_SIZE = 16
BLOCKS_PER_ROW = 4  # 4 + 49 tokens
FAVOURED = 10.0  # logit bias of the tokens the grammar never allows


def byte_level_tokenizer() -> Tokenizer:
    """A 400-token byte-level BPE trained here (no download), "a" and each digit a token of its own."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=OPT_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def never_allowed(tokenizer: Tokenizer, count: int) -> list[int]:
    """`count` token ids whose text has neither "a" nor a digit: no state of the grammar allows them."""
    ids = [i for i in range(len(OPT_SPECIAL_TOKENS), tokenizer.get_vocab_size())
           if not re.search("[a0-9]", tokenizer.decode([i]))]
    assert len(ids) >= count
    return ids[:count]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tokenizer):
    model = make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=3, vocab_size=VOCAB_SIZE)
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model), device="cuda", dtype="float32",
                                 num_kv_blocks=NUM_ROWS * BLOCKS_PER_ROW + 8, swap_space=0.01))
    worker.setup(worker_pb2.WorkerSetup(
        block_size=BLOCK_SIZE, max_num_seqs=NUM_ROWS, max_num_batched_tokens=NUM_ROWS * PROMPT_LEN,
        max_model_len=BLOCK_SIZE * BLOCKS_PER_ROW,
        structured_output_tokenizer=worker_pb2.StructuredOutputTokenizer(tokenizer_json=tokenizer.to_str(),
                                                                          eos_token_ids=[EOS])))
    return worker


def plans(tokenizer: Tokenizer) -> list[worker_pb2.StepPlan]:
    """Every row's prompt in one step, then NUM_DECODE_STEPS decode steps of every row."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_regex(GRAMMAR_REGEX)
    bias = [worker_pb2.LogitBias(token_id=token, bias=FAVOURED) for token in never_allowed(tokenizer, 100)]
    bias.append(worker_pb2.LogitBias(token_id=EOS, bias=-100.0))  # the grammar allows it once complete
    rng = np.random.default_rng(0)
    new = [worker_pb2.NewRequest(
        request_id=f"r{i}", token_ids=rng.integers(3, 400, size=PROMPT_LEN).tolist(),
        block_ids=list(range(i * BLOCKS_PER_ROW, (i + 1) * BLOCKS_PER_ROW)), num_computed_tokens=0,
        num_scheduled_tokens=PROMPT_LEN, num_prompt_tokens=PROMPT_LEN,
        sampling=worker_pb2.WorkerSamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=1000 + i,
                                                 num_logprobs=-1, num_prompt_logprobs=-1, logit_bias=bias,
                                                 structured_grammar=grammar))
        for i in range(NUM_ROWS)]
    decode = [worker_pb2.ScheduledRequest(request_id=f"r{i}", num_scheduled_tokens=1) for i in range(NUM_ROWS)]
    steps = [worker_pb2.StepPlan(step_id=0, new_requests=new)]
    return steps + [worker_pb2.StepPlan(step_id=step, scheduled_requests=decode)
                    for step in range(1, NUM_DECODE_STEPS + 1)]


def test_a_constrained_row_never_samples_a_masked_token(worker, tokenizer):
    outputs: dict[str, list[int]] = {}
    for plan in plans(tokenizer):
        result = worker.execute(plan)
        assert not result.failed_requests, (
            f"step {plan.step_id}: the worker's matchers rejected sampled tokens: "
            f"{[(f.request_id, f.reason) for f in result.failed_requests[:5]]}")
        for request_id, token_id in zip(result.sampled.request_ids, result.sampled.token_ids):
            outputs.setdefault(request_id, []).append(token_id)
    assert len(outputs) == NUM_ROWS
    rejected = {request_id: tokenizer.decode(tokens) for request_id, tokens in outputs.items()
                if len(tokens) != NUM_DECODE_STEPS + 1 or not OUTPUT.fullmatch(tokenizer.decode(tokens))}
    assert not rejected, f"{len(rejected)} rows sampled tokens their grammar masks out, e.g. {list(rejected.items())[:3]}"
