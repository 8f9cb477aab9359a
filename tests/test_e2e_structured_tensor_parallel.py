"""Structured outputs under tensor parallelism: with two ranks (gloo, CPU) every rank keeps its own grammar
matchers, fed by the same plans and the same sampled tokens, so a seeded constrained request draws exactly the
tokens it draws with one rank, and every output is valid and complete."""

from __future__ import annotations

import json

import jsonschema

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "string", "maxLength": 5}, "kind": {"enum": ["x", "yy"]},
                   "sizes": {"type": "array", "items": {"enum": [1, 22, 333]}, "maxItems": 2}},
    "required": ["id", "kind", "sizes"],
    "additionalProperties": False,
}
ASK = dict(temperature=1.0, seed=11, n=4, max_tokens=80,
           structured_outputs=dict(json=json.dumps(SCHEMA), disable_any_whitespace=True))


def test_a_seeded_constrained_request_draws_the_same_tokens_with_one_rank_and_two(tmp_path):
    # One KV head and a vocabulary that splits in two: the replicated-KV and vocab-parallel paths both run.
    model = add_embedded_tokenizer(make_tiny_model(tmp_path, "llama", seed=6, vocab_size=49216, eos_token_id=2,
                                                   num_key_value_heads=1))
    results = {}
    for ranks in ("1", "2"):
        (tmp_path / f"tp{ranks}").mkdir()
        with running_server(tmp_path / f"tp{ranks}", "--model", str(model), "-tp", ranks, "--max-model-len",
                            "256") as server, server.client() as client:
            results[ranks] = client.generate("Describe it", **ASK)
    for output in results["2"].outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), SCHEMA)
    assert [o.token_ids for o in results["2"].outputs] == [o.token_ids for o in results["1"].outputs]
