"""An EAGLE-3 head on the worker: its proposals equal an independent torch reference of the EAGLE-3 math run on
the hidden states transformers returns (`output_hidden_states`) for the row's known tokens, after a prefill in
chunks, after verified steps (drafts partly kept), with vLLM's default target layers and with the config's,
with a reduced draft vocabulary (d2t) and with the head's own embeddings. The worker refuses what it does not
serve, by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedserve.testing.tiny_eagle3 import make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from worker_svc.config import WorkerConfig
from worker_svc.models.eagle3 import read_checkpoint
from worker_svc.worker import Worker

BLOCK = 4
K = 3
PROMPT = [5, 9, 2, 7, 3, 5, 9, 40, 41, 17, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3, num_hidden_layers=5)


def make_worker(target, head, k=K) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(target), num_kv_blocks=32, swap_space=0.01))
    setup = worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=40)
    setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(head), num_speculative_tokens=k, method="eagle3"))
    worker.setup(setup)
    return worker


def new_request(request_id, tokens, num_scheduled) -> worker_pb2.NewRequest:
    first_block = 0 if request_id == "a" else 10
    return worker_pb2.NewRequest(
        request_id=request_id, token_ids=tokens, block_ids=list(range(first_block, first_block + 10)),
        num_computed_tokens=0, num_scheduled_tokens=num_scheduled, num_prompt_tokens=len(tokens),
        sampling=worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, seed=1, num_logprobs=-1,
                                                 num_prompt_logprobs=-1))


def step(worker, new=(), scheduled=(), propose=K) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each sampling request's new tokens (kept drafts, then its token) and its proposals."""
    plan = worker_pb2.StepPlan(new_requests=list(new), scheduled_requests=list(scheduled),
                               has_draft_tokens=any(s.draft_token_ids for s in scheduled), propose_draft_tokens=propose)
    sampled = worker.execute(plan).sampled
    drafts = {s.request_id: list(s.draft_token_ids) for s in scheduled}
    tokens, proposals, start = {}, {}, 0
    for index, request_id in enumerate(sampled.request_ids):
        kept = sampled.num_accepted_drafts[index] if sampled.num_accepted_drafts else 0
        tokens[request_id] = drafts.get(request_id, [])[:kept] + [sampled.token_ids[index]]
        count = sampled.num_proposed_draft_tokens[index] if sampled.num_proposed_draft_tokens else 0
        proposals[request_id], start = list(sampled.proposed_draft_token_ids[start : start + count]), start + count
    return tokens, proposals


def decode(request_id, drafts=()) -> worker_pb2.ScheduledRequest:
    return worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1 + len(drafts),
                                       draft_token_ids=list(drafts))


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta):
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1)[:, None], torch.cat([angles, angles], -1)[:, None]
    cos, sin = cos.cos(), sin.sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class ReferenceHead:
    """The EAGLE-3 head's math over a whole sequence, plain torch (no paging, no fused layers)."""

    def __init__(self, head_dir, embeddings):
        self.w = read_checkpoint(head_dir)
        self.config = json.loads((head_dir / "config.json").read_text())
        self.embeddings = self.w.get("embed_tokens.weight", embeddings)
        self.keys, self.values = [], []

    def layer(self, token_ids, states, positions):
        w, c = self.w, self.config
        eps, heads, kv_heads, dim = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = torch.cat([rms(self.embeddings[token_ids], w["midlayer.input_layernorm.weight"], eps),
                       rms(states, w["midlayer.hidden_norm.weight"], eps)], -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, dim)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        q, k = rope(q, positions, c["rope_theta"]), rope(k, positions, c["rope_theta"])
        self.keys.append(k), self.values.append(v)
        keys = torch.cat(self.keys).repeat_interleave(heads // kv_heads, 1)
        values = torch.cat(self.values).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / dim**0.5
        seen = torch.arange(len(keys))[None, :] <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        attn = torch.einsum("hqk,khd->qhd", probs, values).reshape(len(q), -1) @ w["midlayer.self_attn.o_proj.weight"].T
        h = states + attn
        m = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        out = h + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                   * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        draft = torch.argmax(rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T, -1)
        return draft + w["d2t"][draft], out


def reference_proposals(hf_model, head_dir, layers, tokens, k) -> list[int]:
    """k greedy proposals after `tokens`: the head over positions 0..N-2 (state: fc of the target's states
    entering `layers`, token: the next one), then its own outputs fed back."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        reference = ReferenceHead(head_dir, hf_model.model.embed_tokens.weight)
        aux = torch.cat([hidden[i][0] for i in sorted(layers)], -1)[:-1]
        states = aux @ reference.w["fc.weight"].T
        n = len(tokens) - 1
        proposals, out = reference.layer(torch.tensor(tokens[1:]), states, torch.arange(n))
        token, state, result = proposals[-1:], out[-1:], [int(proposals[-1])]
        for position in range(n, n + k - 1):
            token, state = reference.layer(token, state, torch.tensor([position]))
            result.append(int(token))
    return result


@pytest.mark.parametrize("options", [
    {},  # vLLM's default layers (2, L // 2, L - 3), the whole vocabulary
    {"aux_layer_ids": [3, 0, 4], "own_embeddings": True, "draft_vocab_size": 200},  # unsorted; layer 0: embeddings
])
def test_proposals_equal_the_reference_eagle3_math_on_the_targets_hidden_states(target, tmp_path, options):
    from transformers import AutoModelForCausalLM

    head = make_tiny_eagle3_head(tmp_path, target, seed=7, **options)
    layers = options.get("aux_layer_ids") or [2, 5 // 2, 5 - 3]
    hf_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    worker = make_worker(target, head)
    known = {"a": list(PROMPT), "b": list(PROMPT[3:9])}
    # "a" prefills in two chunks beside "b" (whose decodes run first in the step: single tokens first).
    new, proposals = step(worker, new=[new_request("a", known["a"], 6), new_request("b", known["b"], 6)])
    assert list(new) == ["b"]
    known["b"] += new["b"]
    assert proposals["b"] == reference_proposals(hf_model, head, layers, known["b"], K)
    new, proposals = step(worker, new=(), scheduled=[worker_pb2.ScheduledRequest(request_id="a", num_scheduled_tokens=5),
                                                     decode("b", proposals["b"])])
    kept_some = rejected_some = False
    for _ in range(4):
        for request_id in new:
            known[request_id] += new[request_id]
            assert proposals[request_id] == reference_proposals(hf_model, head, layers, known[request_id], K)
        # "a" verifies drafts whose first token is the target's own next one (kept) and then the head's; "b" the
        # head's alone (a random head: mostly rejected).
        truth = int(torch.argmax(hf_model(torch.tensor([known["a"]])).logits[0, -1]))
        drafts = {"a": [truth] + proposals["a"][1:], "b": proposals["b"]}
        new, proposals = step(worker, scheduled=[decode("a", drafts["a"]), decode("b", drafts["b"])])
        kept_some |= len(new["a"]) > 1
        rejected_some |= len(new["b"]) < 1 + K
    assert kept_some and rejected_some


def test_a_head_with_a_shorter_position_table_than_the_target_covers_the_targets_positions(target, tmp_path):
    """Published heads often say 2048 positions for a 128k target: the head runs at the target's positions, so
    its rotary table must reach them (a 64-row table was read out of bounds at position 300)."""
    from worker_svc.layers.rotary_embedding import RotaryEmbedding
    from worker_svc.models.eagle3_config import eagle3_refusal, read_eagle3_config
    from worker_svc.model_config import ModelConfig

    head = make_tiny_eagle3_head(tmp_path / "head", target)
    config_path = head / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "max_position_embeddings": 64}))
    target_config = ModelConfig.from_path(target)
    assert target_config.max_position_embeddings > 300
    assert eagle3_refusal(head, target_config, 1) is None
    config, _, _ = read_eagle3_config(head, target_config.num_hidden_layers, target_config.max_position_embeddings)
    rotary = RotaryEmbedding(config, None)
    assert rotary.cos_sin_cache.shape[0] >= target_config.max_position_embeddings


def test_a_head_config_without_a_size_is_refused_naming_it(target, tmp_path):
    from worker_svc.models.eagle3_config import eagle3_refusal
    from worker_svc.model_config import ModelConfig

    head = make_tiny_eagle3_head(tmp_path / "head", target)
    config_path = head / "config.json"
    raw = json.loads(config_path.read_text())
    del raw["hidden_size"]
    config_path.write_text(json.dumps(raw))
    refusal = eagle3_refusal(head, ModelConfig.from_path(target), 1)
    assert refusal is not None and "config.json lacks hidden_size" in refusal
