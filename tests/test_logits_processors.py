"""The worker's logits processors and the sampler's min_p and top logprobs, through the persistent batch's
host path (`sampling_inputs.build_sampling_tensors`): penalties equal transformers' processors (repetition)
and OpenAI's definition (frequency, presence) on the same logits, and a dense reference on mixed batches;
logit_bias adds, bad_words and min_tokens mask (each entry on its own row and token when rows mix them),
min_p never samples below its threshold, and ranks / top-k equal log_softmax of the raw logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from protos.pagedserve.v1 import worker_pb2
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.sampling.logits_processors import apply_adjustments
from worker_svc.sampling.sampler import sample
from worker_svc.sampling.sampling_inputs import build_sampling_tensors

VOCAB = 64


def _batch(rows: list[dict]) -> tuple[PersistentBatch, np.ndarray]:
    """A persistent batch holding one row per dict (request r{i}), and those rows in order."""
    batch = PersistentBatch(max_num_seqs=len(rows), max_model_len=256, block_size=16)
    indices = [batch.add(_new_request(i, row)) for i, row in enumerate(rows)]
    return batch, np.asarray(indices, dtype=np.int64)


def _new_request(i: int, row: dict) -> worker_pb2.NewRequest:
    """Request r{i} from a dict: prompt, output (generated tokens) and sampling fields."""
    prompt, output = row.get("prompt", [1, 2, 3]), row.get("output", [])
    sampling = worker_pb2.WorkerSamplingParams(
        temperature=row.get("temperature", 0.0), top_p=1.0, top_k=-1, seed=row.get("seed", i),
        repetition_penalty=row.get("repetition_penalty", 1.0),
        presence_penalty=row.get("presence_penalty", 0.0), frequency_penalty=row.get("frequency_penalty", 0.0),
        min_p=row.get("min_p", 0.0), min_tokens=row.get("min_tokens", 0),
        min_tokens_masked_ids=row.get("min_tokens_masked_ids", []),
        logit_bias=[worker_pb2.LogitBias(token_id=t, bias=b) for t, b in row.get("logit_bias", {}).items()],
        bad_words=[worker_pb2.BadWord(token_ids=w) for w in row.get("bad_words", [])],
        num_logprobs=row.get("logprobs", -1), num_prompt_logprobs=-1,
    )
    return worker_pb2.NewRequest(request_id=f"r{i}", token_ids=prompt + output, sampling=sampling,
                                 num_prompt_tokens=len(prompt))


def _processed(rows: list[dict], logits: torch.Tensor) -> torch.Tensor:
    batch, indices = _batch(rows)
    tensors = build_sampling_tensors(batch, indices, "cpu")
    return apply_adjustments(logits, tensors.adjustments)


def _random_tokens(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator) * 3
    rows = [dict(prompt=_random_tokens(generator, 10), output=_random_tokens(generator, n), repetition_penalty=p)
            for n, p in [(0, 1.3), (5, 1.3), (12, 0.7), (3, 2.0), (1, 1.05), (7, 1.0)]]
    processed = _processed(rows, logits)
    for i, row in enumerate(rows):
        input_ids = torch.tensor([row["prompt"] + row["output"]])
        expected = RepetitionPenaltyLogitsProcessor(row["repetition_penalty"])(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(processed[i], expected[0], rtol=0, atol=1e-6)
    assert not torch.equal(processed[:5], logits[:5]), "the penalty changed the logits"


def test_frequency_and_presence_penalties_follow_openai_over_output_tokens_only():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=generator)
    rows = [dict(prompt=_random_tokens(generator, 8), output=_random_tokens(generator, 20), frequency_penalty=f,
                 presence_penalty=p) for f, p in [(0.5, 0.0), (0.0, 1.5), (-0.4, 0.8), (2.0, -2.0)]]
    processed = _processed(rows, logits)
    for i, row in enumerate(rows):
        expected = logits[i].clone()
        for token, count in Counter(row["output"]).items():  # prompt tokens are not penalized
            expected[token] -= row["frequency_penalty"] * count + row["presence_penalty"]
        torch.testing.assert_close(processed[i], expected, rtol=0, atol=1e-5)


def test_all_three_penalties_together_equal_transformers_then_openai():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, VOCAB, generator=generator) * 2
    row = dict(prompt=_random_tokens(generator, 6), output=_random_tokens(generator, 9), repetition_penalty=1.5,
               frequency_penalty=0.3, presence_penalty=0.2)
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([row["prompt"] + row["output"]]), logits.clone())[0]
    for token, count in Counter(row["output"]).items():
        expected[token] -= 0.3 * count + 0.2
    torch.testing.assert_close(_processed([row], logits)[0], expected, rtol=0, atol=1e-5)


def _dense_reference(logits: torch.Tensor, rows: list[dict]) -> torch.Tensor:
    """logit_bias, then the penalties over the whole vocabulary, row by row: counts by bincount."""
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token, bias in row.get("logit_bias", {}).items():
            expected[i, token] += bias
        counts = torch.bincount(torch.tensor(row["output"], dtype=torch.long), minlength=VOCAB).float()
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[row["prompt"] + row["output"]] = True
        repetition, frequency, presence = (torch.tensor(row.get(name, default), dtype=torch.float32) for name, default
                                           in [("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                               ("presence_penalty", 0.0)])
        penalized = torch.where(seen & (expected[i] > 0), expected[i] / repetition,
                                torch.where(seen, expected[i] * repetition, expected[i]))
        expected[i] = penalized - frequency * counts - presence * (counts > 0)
    return expected


def test_sparse_penalties_equal_a_dense_reference_on_rows_of_mixed_lengths_and_penalties():
    generator = torch.Generator().manual_seed(6)
    penalties = [dict(), dict(repetition_penalty=1.3), dict(repetition_penalty=0.6), dict(frequency_penalty=0.7),
                 dict(presence_penalty=-1.1),
                 dict(repetition_penalty=1.2, frequency_penalty=-0.4, presence_penalty=0.9)]
    rows = []
    for i in range(40):
        # A 64-token vocabulary and up to 50 tokens per part: repeats, and tokens in both prompt and output.
        prompt = _random_tokens(generator, int(torch.randint(1, 50, (1,), generator=generator)))
        output = _random_tokens(generator, int(torch.randint(0, 50, (1,), generator=generator)))
        bias = {prompt[0]: 4.0, 63: -2.5} if i % 5 == 0 else {}  # applied first: may flip a logit's sign
        rows.append(dict(prompt=prompt, output=output, logit_bias=bias, **penalties[i % len(penalties)]))
    logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
    processed = _processed(rows, logits)
    torch.testing.assert_close(processed, _dense_reference(logits, rows), rtol=0, atol=0)
    unpenalized = [i for i, row in enumerate(rows) if not row["logit_bias"] and i % len(penalties) == 0]
    assert torch.equal(processed[unpenalized], logits[unpenalized]), "rows without penalties are untouched"
    assert not torch.equal(processed[1], logits[1])


def test_logit_bias_adds_to_its_tokens_and_moves_the_greedy_choice():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    rows = [dict(logit_bias={3: 6.0, 10: -1.0}), dict()]
    processed = _processed(rows, logits)
    expected = logits.clone()
    expected[0, 3] += 6.0
    expected[0, 10] -= 1.0
    torch.testing.assert_close(processed, expected)
    batch, indices = _batch(rows)
    assert sample(logits, build_sampling_tensors(batch, indices, "cpu")).token_ids.tolist() == [3, 10]


def test_min_tokens_masks_stop_ids_until_reached_then_frees_them():
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 30.0  # the "EOS" would win every draw
    logits[:, 8] = 29.0  # a stop token id too
    common = dict(min_tokens=3, min_tokens_masked_ids=[7, 8], temperature=1.0)
    rows = [dict(output=[], **common), dict(output=[4, 5], **common), dict(output=[4, 5, 6], **common)]
    processed = _processed(rows, logits)
    assert torch.isinf(processed[:2, [7, 8]]).all() and (processed[:2, [7, 8]] < 0).all()
    assert torch.equal(processed[2], logits[2]), "min_tokens reached: nothing masked"
    batch, indices = _batch(rows)
    token_ids = sample(logits, build_sampling_tensors(batch, indices, "cpu")).token_ids.tolist()
    assert token_ids[0] not in (7, 8) and token_ids[1] not in (7, 8) and token_ids[2] == 7


def test_bad_words_equal_transformers_no_bad_words_over_the_output():
    generator = torch.Generator().manual_seed(3)
    bad_words = [[5], [9, 11], [20, 21, 22], [30, 31]]
    outputs = [[], [9], [1, 20, 21], [20, 21, 4], [30], [2, 9, 30]]
    logits = torch.randn(len(outputs), VOCAB, generator=generator)
    rows = [dict(output=output, bad_words=bad_words) for output in outputs]
    processed = _processed(rows, logits)
    for i, output in enumerate(outputs):
        # transformers looks at the whole sequence; vLLM (and we) at the output only: give it the output.
        processor = NoBadWordsLogitsProcessor(bad_words, eos_token_id=None)
        expected = processor(torch.tensor([[0] + output]), logits[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(processed[i]), torch.isinf(expected)), f"row {i}"
        assert torch.equal(processed[i][~torch.isinf(expected)], logits[i][~torch.isinf(expected)])
    assert torch.isinf(processed[1, 11]) and not torch.isinf(processed[0, 11])


def _sparse_reference(logits: torch.Tensor, rows: list[dict]) -> torch.Tensor:
    """Row by row, the obvious way: add each logit_bias, mask the min_tokens ids while the output is shorter
    than min_tokens, mask each bad word's last token when the output ends with the word's other tokens."""
    expected = logits.clone()
    for i, row in enumerate(rows):
        output = row.get("output", [])
        for token, bias in row.get("logit_bias", {}).items():
            expected[i, token] += bias
        if len(output) < row.get("min_tokens", 0):
            expected[i, row["min_tokens_masked_ids"]] = -float("inf")
        for word in row.get("bad_words", []):
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                expected[i, word[-1]] = -float("inf")
    return expected


def test_sparse_entries_of_mixed_rows_land_on_their_own_rows_and_tokens():
    generator = torch.Generator().manual_seed(7)
    bad_words = [[5], [9, 11], [20, 21, 22]]
    masked = dict(min_tokens=4, min_tokens_masked_ids=[7, 8, 40])
    rows = [
        dict(output=[1, 2], logit_bias={3: 2.5, 60: -1.25}, **masked),  # masked: 2 < 4
        dict(output=[1, 2, 3, 4], logit_bias={7: 3.0}, **masked),  # min_tokens reached: bias only
        dict(output=[9], logit_bias={11: 1.5}, bad_words=bad_words),  # bias then [9, 11]'s ban on one token
        dict(output=[]),
        dict(output=[20, 21], bad_words=bad_words, **masked),  # [20, 21, 22] banned, [9, 11] not
        dict(prompt=[9], output=[], bad_words=bad_words),  # a word does not continue across the prompt
        dict(output=[0] * 6, logit_bias={7: -0.5, 8: 4.0}, **masked),  # past min_tokens
        dict(output=[5, 9], logit_bias={63: 0.75}, bad_words=bad_words, min_tokens=9,
             min_tokens_masked_ids=[11, 63]),  # everything at once, two entries on 11 and on 63
        dict(output=[4], min_tokens=2, min_tokens_masked_ids=[0]),
    ]
    batch, indices = _batch(rows)
    # r0 and r4 leave and come back in each other's rows: their pool runs now follow the others'.
    for i in (0, 4):
        batch.remove(f"r{i}")
    for i in (0, 4):
        batch.add(_new_request(i, rows[i]))
    assert (batch.row_of("r0"), batch.row_of("r4")) == (indices[4], indices[0])
    step = np.asarray([6, 2, 0, 8, 3, 5, 1, 7, 4])  # requests r{i}, in another order than their rows
    step_rows = [rows[i] for i in step]
    logits = torch.randn(len(step), VOCAB, generator=generator) * 3
    tensors = build_sampling_tensors(batch, np.asarray([batch.row_of(f"r{i}") for i in step]), "cpu")
    assert torch.equal(apply_adjustments(logits, tensors.adjustments), _sparse_reference(logits, step_rows))
    sparse = tensors.adjustments.sparse
    assert len({t.untyped_storage().data_ptr() for t in (sparse.rows, sparse.token_ids, sparse.values)}) == 1, \
        "one buffer, one host-to-device copy"


def test_min_p_never_samples_below_its_threshold_and_keeps_the_rest_in_proportion():
    num_draws = 6000
    logits = torch.linspace(4.0, -4.0, VOCAB).unsqueeze(0).expand(num_draws, VOCAB).contiguous()
    min_p, temperature = 0.1, 1.5
    rows = [dict(temperature=temperature, min_p=min_p, seed=1000 + i) for i in range(num_draws)]
    batch, indices = _batch(rows)
    drawn = sample(logits, build_sampling_tensors(batch, indices, "cpu")).token_ids
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    kept = probs >= min_p * probs.max()
    assert kept.sum() < VOCAB // 2, "the threshold really cuts"
    assert kept[drawn].all(), "no draw below min_p x the best probability"
    # The kept tokens keep their relative probabilities, as transformers' MinPLogitsWarper computes them.
    warped = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), (logits[:1] / temperature).clone())
    expected = torch.softmax(warped[0], dim=-1)
    frequencies = torch.bincount(drawn, minlength=VOCAB).float() / num_draws
    assert (frequencies - expected).abs().max() < 0.025
    unmasked = sample(logits, build_sampling_tensors(*_batch([dict(r, min_p=0.0) for r in rows]), "cpu"))
    assert not kept[unmasked.token_ids].all(), "without min_p some draws fall below the threshold"


def test_ranks_and_top_logprobs_equal_log_softmax_of_the_raw_logits():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, VOCAB, generator=generator) * 2
    logits[4, 10] = logits[4, 11] = logits[4].max() + 1  # a tie at the top
    rows = [dict(logprobs=k, temperature=t, seed=i, presence_penalty=0.5, output=[int(logits[i].argmax())])
            for i, (k, t) in enumerate([(0, 0.0), (3, 1.0), (5, 0.7), (1, 1.0), (2, 0.0)])]
    batch, indices = _batch(rows)
    out = sample(logits, build_sampling_tensors(batch, indices, "cpu"))
    reference = torch.log_softmax(logits, dim=-1)
    chosen = reference.gather(-1, out.token_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logprobs, chosen)
    assert out.ranks.tolist() == (1 + (reference > chosen.unsqueeze(-1)).sum(-1)).tolist()
    assert out.top_ids.shape == (5, 5)
    top = torch.topk(reference, 5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert set(out.top_ids[4, :2].tolist()) == {10, 11}
    # The penalty moved greedy row 0 off the raw argmax; its rank is still that of the raw logits.
    assert out.ranks[0] > 1 or out.token_ids[0] == logits[0].argmax()


def test_no_adjustments_and_no_top_logprobs_when_no_row_asks():
    batch, indices = _batch([dict(), dict(temperature=1.0)])
    tensors = build_sampling_tensors(batch, indices, "cpu")
    assert tensors.adjustments is None and tensors.num_top_logprobs == -1 and not tensors.restricts
    out = sample(torch.randn(2, VOCAB), tensors)
    assert out.ranks is None and out.top_ids is None


@pytest.mark.parametrize("penalty", [dict(frequency_penalty=1.0), dict(repetition_penalty=1.2)])
def test_a_penalized_seeded_row_draws_the_same_token_whatever_rows_surround_it(penalty):
    generator = torch.Generator().manual_seed(5)
    probe = dict(prompt=[4, 5, 6], output=[7, 7, 8], temperature=1.0, seed=99, **penalty)
    probe_logits = torch.randn(1, VOCAB, generator=generator)
    alone = sample(probe_logits, build_sampling_tensors(*_batch([probe]), "cpu")).token_ids[0]
    fillers = [dict(output=_random_tokens(generator, 30), temperature=1.0, seed=i, presence_penalty=0.5)
               for i in range(7)]
    rows = fillers[:3] + [probe] + fillers[3:]
    logits = torch.randn(8, VOCAB, generator=generator)
    logits[3] = probe_logits[0]
    batch, indices = _batch(rows)
    assert sample(logits, build_sampling_tensors(batch, indices, "cpu")).token_ids[3] == alone
