"""An EAGLE-1 head on the worker: its proposals equal an independent torch reference of the EAGLE-1 math run on
the final hidden states transformers returns (`hidden_states[-1]`, after the final norm) for the row's known
tokens, after a prefill in chunks and after verified steps (drafts partly kept): with one layer, fc's bias and the
target's embeddings (a shipped copy of them dropped) and LM head from a pytorch_model.bin, and with two layers, the
head's own embeddings and LM head. The launcher's refusals (torch-free) name what is not served."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.testing.tiny_eagle1 import make_tiny_eagle1_head
from pagedserve.testing.tiny_eagle3 import make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from tests.test_eagle3_head import BLOCK, PROMPT, decode, new_request, rms, rope, step
from worker_svc.config import WorkerConfig
from worker_svc.model_config import ModelConfig
from worker_svc.models.eagle1_config import eagle1_refusal
from worker_svc.models.eagle3 import read_checkpoint
from worker_svc.worker import Worker

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3, num_hidden_layers=5)


def make_worker(target, head) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(target), num_kv_blocks=32, swap_space=0.01))
    setup = worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=40)
    setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(head), num_speculative_tokens=K, method="eagle"))
    worker.setup(setup)
    return worker


class ReferenceEagle1:
    """EAGLE-1's math over a whole sequence, plain torch (no paging, no fused layers): fc over [embedding, state],
    layer 0 without its input norm, no final norm, the LM head on the output state."""

    def __init__(self, head_dir, embeddings, lm_head):
        self.w = read_checkpoint(head_dir)
        self.config = json.loads((head_dir / "config.json").read_text())
        self.embeddings = self.w.get("embed_tokens.weight", embeddings)
        self.lm_head = self.w.get("lm_head.weight", lm_head)
        self.caches = [([], []) for _ in range(self.config["num_hidden_layers"])]

    def attention(self, index, x, positions):
        w, c = self.w, self.config
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        p = f"layers.{index}.self_attn."
        q = (x @ w[p + "q_proj.weight"].T).view(-1, heads, dim)
        k = (x @ w[p + "k_proj.weight"].T).view(-1, kv_heads, dim)
        v = (x @ w[p + "v_proj.weight"].T).view(-1, kv_heads, dim)
        q, k = rope(q, positions, c["rope_theta"]), rope(k, positions, c["rope_theta"])
        keys, values = self.caches[index]
        keys.append(k), values.append(v)
        all_keys = torch.cat(keys).repeat_interleave(heads // kv_heads, 1)
        all_values = torch.cat(values).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, all_keys) / dim**0.5
        seen = torch.arange(len(all_keys))[None, :] <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", probs, all_values).reshape(len(q), -1) @ w[p + "o_proj.weight"].T

    def step(self, token_ids, states, positions):
        """(greedy tokens, output states) of positions whose next tokens are `token_ids`."""
        w, eps = self.w, self.config["rms_norm_eps"]
        x = torch.cat([self.embeddings[token_ids], states], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        for index in range(self.config["num_hidden_layers"]):
            p = f"layers.{index}."
            x = x + self.attention(index, x if index == 0 else rms(x, w[p + "input_layernorm.weight"], eps), positions)
            m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
                     * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return torch.argmax(x @ self.lm_head.T, -1), x


def reference_proposals(hf_model, head_dir, tokens, k) -> list[int]:
    """k greedy proposals after `tokens`: the head over positions 0..N-2 (state: the target's final hidden state,
    token: the next one), then its own outputs fed back."""
    with torch.no_grad():
        final = hf_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        reference = ReferenceEagle1(head_dir, hf_model.get_input_embeddings().weight,
                                    hf_model.get_output_embeddings().weight)
        n = len(tokens) - 1
        proposals, out = reference.step(torch.tensor(tokens[1:]), final[:-1], torch.arange(n))
        token, state, result = proposals[-1:], out[-1:], [int(proposals[-1])]
        for position in range(n, n + k - 1):
            token, state = reference.step(token, state, torch.tensor([position]))
            result.append(int(token))
    return result


def as_published(head, target) -> None:
    """Rewrites the head's checkpoint as the EAGLE repo publishes its heads: pytorch_model.bin, with a copy of the
    target's embeddings."""
    from safetensors.torch import load_file

    weights = load_file(head / "model.safetensors")
    weights["embed_tokens.weight"] = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    torch.save(weights, head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()


@pytest.mark.parametrize("options", [
    {},  # one layer, fc.bias, the target's embeddings (its copy shipped) and LM head, in pytorch_model.bin
    {"num_layers": 2, "fc_bias": False, "own_embeddings": True, "own_lm_head": True},
])
def test_proposals_equal_the_reference_eagle1_math_on_the_targets_final_hidden_states(target, tmp_path, options):
    from transformers import AutoModelForCausalLM

    head = make_tiny_eagle1_head(tmp_path, target, seed=7, **options)
    if not options:
        as_published(head, target)
    hf_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    worker = make_worker(target, head)
    module = worker.runner.draft.model
    assert (module.embed_tokens is None, module.lm_head is None) == ((True, True) if not options else (False, False))
    known = {"a": list(PROMPT), "b": list(PROMPT[3:9])}
    # "a" prefills in two chunks beside "b" (whose decodes run first in the step: single tokens first).
    new, proposals = step(worker, new=[new_request("a", known["a"], 6), new_request("b", known["b"], 6)], propose=K)
    assert list(new) == ["b"]
    known["b"] += new["b"]
    assert proposals["b"] == reference_proposals(hf_model, head, known["b"], K)
    new, proposals = step(worker, scheduled=[worker_pb2.ScheduledRequest(request_id="a", num_scheduled_tokens=5),
                                             decode("b", proposals["b"])], propose=K)
    kept_some = rejected_some = False
    for _ in range(4):
        for request_id in new:
            known[request_id] += new[request_id]
            assert proposals[request_id] == reference_proposals(hf_model, head, known[request_id], K)
        # "a" verifies drafts whose first token is the target's own next one (kept) and then the head's; "b" the
        # head's alone (a random head: mostly rejected).
        truth = int(torch.argmax(hf_model(torch.tensor([known["a"]])).logits[0, -1]))
        drafts = {"a": [truth] + proposals["a"][1:], "b": proposals["b"]}
        new, proposals = step(worker, scheduled=[decode("a", drafts["a"]), decode("b", drafts["b"])], propose=K)
        kept_some |= len(new["a"]) > 1
        rejected_some |= len(new["b"]) < 1 + K
    assert kept_some and rejected_some


def _edit_config(head, **changes) -> None:
    path = head / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_the_launcher_refuses_eagle1_heads_it_cannot_serve_naming_why(target, tmp_path):
    target_config = ModelConfig.from_path(target)
    head = make_tiny_eagle1_head(tmp_path / "ok", target)
    assert eagle1_refusal(head, target_config, 1) is None
    assert "--tensor-parallel-size 1 only" in eagle1_refusal(head, target_config, 2)
    gemma = make_tiny_model(tmp_path / "gemma", "gemma", seed=1)
    assert "needs a Llama-family target" in eagle1_refusal(head, ModelConfig.from_path(gemma), 1)
    assert "an EAGLE-3 head (method eagle3)" in eagle1_refusal(make_tiny_eagle3_head(tmp_path, target),
                                                               target_config, 1)
    assert "no fc.weight (not an EAGLE-1 head)" in eagle1_refusal(target, target_config, 1)  # a whole model
    for index, (changes, words) in enumerate((
            ({"hidden_size": 128}, "hidden_size 128 and vocab_size 512 must be the target's"),
            ({"vocab_size": 600}, "vocab_size 600 must be the target's"),
            ({"add_para_norm": True}, "add_para_norm (HASS) heads are not served"),
            ({"architectures": ["Qwen2ForCausalLM"]}, "not an EAGLE-1 Llama head"))):
        edited = make_tiny_eagle1_head(tmp_path / f"edited{index}", target)
        _edit_config(edited, **changes)
        refusal = eagle1_refusal(edited, target_config, 1)
        assert refusal is not None and words in refusal, refusal
