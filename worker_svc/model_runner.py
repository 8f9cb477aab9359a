"""The model runner: the one object that runs the model on this worker's device.

Who owns what: the runner owns the model (its weights loaded with the layers' kernels, joined to the
tensor-parallel group), the KV and swap pools (`KVCache`: the per-layer views the attention kernels read),
the graph dispatcher (decode graphs, piecewise graphs or eager: `graph_dispatcher.py`) with the attention
metadata it builds, the sampling kernels and the device-side details of a step (the grammar masks' copy
stream, the pinned copy of the sampled tokens, the device-busy clock). The worker (worker.py) owns what is
not about the device: the plans, the persistent batch of rows, grammar matchers, overlap and results.

Its surface is narrow on purpose: `allocate` (at setup: pools, warm-up, graphs), `move_blocks` (a plan's
swaps and copies), `execute` (a prepared step's forward pass: hidden states, the sampling rows' logits,
prompt logprobs) and `sample` (the draw and its copy to the host), plus `top_logprobs` for beam rows.
Where features plug in, each without a branch in the worker's step: a quantized linear method into
the layers `load_model` builds (and so into every path the dispatcher runs); a draft model (speculative
decoding, draft_model.py) as an object the runner calls around `execute`, with its own KV pool
(proposer_kv_pool.py) and graph dispatcher, captured like the target's: it mirrors each forward pass and
proposes tokens on request (`propose_drafts`); an EAGLE-3 head
(eagle_head.py) in the same place, reading the target's layers' states that the forward pass then returns
(EAGLE-1: its output; `after_sampling` writes its K/V once the step's tokens are on the host); LoRA adapters as
per-token inputs the runner passes to the model (GPU slots in the layers made at setup, written by the plans'
lora_loads before the forward on a stream of their own: lora_adapters.py; each step's slots reach the layers in
the attention metadata, also under the CUDA graphs, which are captured with the adapters' delta). Tests that need
faults wrap the runner (fault_injection.py); a serving runner has no fault hook.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kernels.kv_quant import kv_cache_dtype
from kernels.sampling_ops import batch_invariant_sampling_ops, torch_sampling_ops, triton_sampling_ops
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.model_source import resolve_model
from worker_svc.attention_choice import kernel_set, make_attention_backend, make_layer_ops
from worker_svc.compile_watch import warn_on_compiles_while_serving
from worker_svc.config import GIB, WorkerConfig
from worker_svc.device_busy import DeviceBusyClock
from worker_svc.draft_model import DraftModel
from worker_svc.eagle_head import EAGLE_METHODS, EagleHead
from worker_svc.graph_dispatcher import GraphDispatcher
from worker_svc.host_to_device import to_device
from worker_svc.kernel_warmup import warm_up_kernels
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.kv_cache_sizing import DraftPool, num_kv_blocks
from worker_svc.lora_adapters import LoraAdapterSlots
from worker_svc.model_config import ModelConfig, quantization_name
from worker_svc.models.model_loader import load_model, refused_as_load_refusal
from worker_svc.persistent_batch import PersistentBatch, StepInputs
from worker_svc.sampling.prompt_logprobs import prompt_logprobs
from worker_svc.sampling.rejection_sampler import SampledDrafts, verify_sampled_drafts
from worker_svc.sampling.sampler import SamplerOutput, SamplingTensors, sample
from worker_svc.sampling.sampler_warmup import warm_up_sampler
from worker_svc.tensor_parallel import init_tensor_parallel
from worker_svc.tensor_parallel_fit import shard_refusal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What a step's forward pass leaves for sampling: the logits of the rows that sample (None when none
    does) and the prompt logprobs its chunks scored."""

    logits: torch.Tensor | None
    prompt_logprobs: list[worker_pb2.PromptLogprobs]


@dataclass(frozen=True)
class DeviceSample:
    """A draw on its way to the host. Why a record: the next step may be launched before the host has the
    tokens, and reads them on the device (`token_ids`); the host reads `host` once `copied` has passed.
    `host` is float64 [S, 3 + 2K] (`pack_sampler_output`); `copied` is None on the CPU (nothing in flight)."""

    token_ids: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def wait(self) -> np.ndarray:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.numpy()


class ModelRunner:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.on_gpu = self.device.type == "cuda"
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        model = resolve_model(config.model)
        if config.world_size > 1:
            # Before joining the group: every rank refuses alike, none waits for the others.
            with refused_as_load_refusal():
                model_config = ModelConfig.from_path(model.path, config.quantization)
            refusal = shard_refusal(model_config, config.world_size, "--world-size")
            if refusal is not None:
                raise LoadRefused(refusal)
            # Joining blocks until every rank has come: say where, for a rank that waits long.
            logger.info("rank %d: joining the tensor-parallel group of %d at %s", config.rank, config.world_size,
                        config.distributed_init_method)
        self.tensor_parallel = init_tensor_parallel(config.rank, config.world_size, config.distributed_init_method,
                                                    self.device, self.dtype, config.custom_all_reduce,
                                                    fixed_order=config.batch_invariant)
        self.layer_ops = make_layer_ops(config)
        self.model, self.model_config = load_model(
            model.path, self.dtype, self.device, attention_backend=make_attention_backend(config),
            layer_ops=self.layer_ops, load_format=config.load_format, tensor_parallel=self.tensor_parallel,
            quantization=config.quantization)
        self.model_name = model.name
        # What the hello reports (ModelInfo, /v1/models): vLLM's names for the method and the KV cache's dtype.
        self.quantization = quantization_name(model.path, self.model_config)
        self.kv_cache_dtype_name = "auto" if config.kv_cache_dtype == "auto" else "fp8_e4m3"
        self.kv_cache: KVCache | None = None
        # Speculative decoding with a draft model or an EAGLE head: loaded at setup, which names it
        # (WorkerSetup.draft_model; its method says which).
        self.draft: DraftModel | EagleHead | None = None
        # Multi-LoRA: the adapters' GPU slots and host copies (lora_adapters.py), made at setup with --max-loras.
        self.lora_slots: LoraAdapterSlots | None = None
        self.graphs: GraphDispatcher | None = None
        self.device_busy = DeviceBusyClock(enabled=self.on_gpu)
        # Grammar bitmasks (5 MB a step for 256 rows of a 152k vocabulary) go up on a stream of their own.
        self._mask_copies = torch.cuda.Stream(self.device) if self.on_gpu else None
        # On a GPU each sampler pass is one Triton kernel (kernels/sampling_ops.py).
        self.sampling_ops = triton_sampling_ops() if self.on_gpu else torch_sampling_ops()
        if config.batch_invariant:
            self.sampling_ops = batch_invariant_sampling_ops(self.sampling_ops)

    def allocate(self, setup: worker_pb2.WorkerSetup) -> KVCache:
        """Sizes and allocates the pools (every rank the same number of blocks, the smallest any rank can hold:
        the scheduler's block ids must mean the same slots on every rank), compiles the kernels' variants and
        captures the graphs."""
        config, tensor_parallel, device = self.config, self.tensor_parallel, self.device
        draft_pool = None
        block_bytes = bytes_per_block(self.model_config, setup.block_size, self.kv_dtype, tensor_parallel)
        if setup.max_loras:  # before sizing: the adapters' GPU slots take memory the KV pool cannot have
            if setup.HasField("draft_model"):
                raise LoadRefused("LoRA adapters cannot go with a draft model (speculative decoding)")
            self.lora_slots = LoraAdapterSlots(self.model, setup.max_loras, setup.max_lora_rank,
                                               setup.max_cpu_loras or setup.max_loras, device, self.dtype)
            self.lora_slots.read(list(setup.lora_adapters))
        if setup.HasField("draft_model"):  # before sizing: its weights, activations and pool count
            if setup.draft_model.method in EAGLE_METHODS:
                self.draft = EagleHead(setup.draft_model, self.model, self.model_config, self.dtype, device,
                                       make_attention_backend(config), self.layer_ops, tensor_parallel)
            else:
                self.draft = DraftModel(setup.draft_model, self.model_config, self.dtype, device,
                                        make_attention_backend(config), self.layer_ops, tensor_parallel,
                                        setup.max_model_len)
            draft_block_bytes = self.draft.pool.bytes_per_block(setup.block_size, self.kv_dtype)
            block_bytes += draft_block_bytes
            profiled = self.draft.model if isinstance(self.draft, DraftModel) else None  # a head: one layer
            reserved = self.draft.pool.num_scratch_blocks(setup.block_size, setup.max_num_seqs) * draft_block_bytes
            if isinstance(self.draft, EagleHead):  # the target's wider output, switched on after the profile
                reserved += self.draft.target_state_bytes(setup.max_num_batched_tokens, self.dtype)
                if self._captures_graphs:  # and its proposal graphs' pool, captured after the KV pool's
                    reserved += self.draft.proposal_graph_bytes(_max_proposing_rows(setup),
                                                                self.model_config.vocab_size)
            else:  # sampled proposals' q, kept until their verification
                reserved += self.draft.sampled_draft_bytes(setup.max_num_seqs)
            draft_pool = DraftPool(profiled, self.draft.model_config, draft_block_bytes, reserved,
                                   captured=profiled is not None and self._captures_graphs)
        blocks = num_kv_blocks(config, self.model, self.model_config, setup.block_size,
                               setup.max_num_batched_tokens, setup.max_num_seqs, setup.max_model_len,
                               self.kv_dtype, device, tensor_parallel, draft_pool)
        swap_blocks = int(config.swap_space * GIB) // block_bytes
        blocks = tensor_parallel.all_reduce_min(blocks, device)
        swap_blocks = tensor_parallel.all_reduce_min(swap_blocks, device)
        self.kv_cache = KVCache(self.model_config, blocks, swap_blocks, setup.block_size, self.kv_dtype, device,
                                tensor_parallel)
        if self.draft is not None:
            self.draft.pool.allocate(blocks, swap_blocks, setup.block_size, setup.max_num_seqs, self.kv_dtype)
        layers = self.kv_cache.layers
        max_blocks_per_seq = PersistentBatch.max_blocks_per_seq(setup.max_model_len, setup.block_size)
        if self.on_gpu:
            warm_up_sampler(self.model_config.vocab_size, self.sampling_ops, device)
            if kernel_set(config) == "triton":
                warm_up_kernels(self.model, layers, setup.block_size, max_blocks_per_seq, setup.max_num_seqs, device)
                if isinstance(self.draft, DraftModel):
                    warm_up_kernels(self.draft.model, self.draft.pool.layers, setup.block_size,
                                    max_blocks_per_seq, setup.max_num_seqs, device)
        if self.draft is not None:  # after the profile and warm-ups, before the graphs capture the wider output
            self.model.aux_hidden_layers = self.draft.target_layers_read
        with_lora = self.lora_slots is not None and self.lora_slots.capturable
        self.graphs = self._dispatcher(self.model, layers, setup, max_blocks_per_seq, with_lora)
        if isinstance(self.draft, DraftModel):  # its own graphs (and memory pool), after the target's
            self.draft.graphs = self._dispatcher(self.draft.model, self.draft.pool.layers, setup, max_blocks_per_seq,
                                                 with_lora=False)
            logger.info("rank %d: the draft model's passes run by %s", config.rank,
                        ", ".join(path.name for path in self.draft.graphs.paths))
        if isinstance(self.draft, EagleHead):
            if self._captures_graphs:  # after the target's graphs, over the head's pool
                self.draft.capture_graphs(_max_proposing_rows(setup), max_blocks_per_seq)
            logger.info("rank %d: the EAGLE head's proposal passes after the first run %s", config.rank,
                        "eagerly" if self.draft.graphs is None
                        else f"from CUDA graphs for {self.draft.graphs.buckets} rows")
        if self.on_gpu:
            warn_on_compiles_while_serving()
        logger.info("rank %d: %d KV blocks, %d swap blocks", config.rank, blocks, swap_blocks)
        return self.kv_cache

    @property
    def _captures_graphs(self) -> bool:
        return self.on_gpu and self.config.cuda_graphs

    def _dispatcher(self, model, layers: list[torch.Tensor], setup: worker_pb2.WorkerSetup, max_blocks_per_seq: int,
                    with_lora: bool) -> GraphDispatcher:
        """How `model`'s forward passes over the pool `layers` run: captured graphs on a GPU (unless
        --enforce-eager), else eagerly."""
        config = self.config
        if not self._captures_graphs:
            return GraphDispatcher(model, layers, setup.block_size, self.device)
        return GraphDispatcher.captured(model, layers, setup.block_size, self.device, setup.max_num_seqs,
                                        max_blocks_per_seq, config.world_size, config.rank, with_lora)

    def load_loras(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's LoRA adapters into their GPU slots, on the load stream (lora_adapters.py), before its forward
        pass."""
        if plan.lora_loads:
            if self.lora_slots is None:
                raise ValueError(f"step {plan.step_id}: LoRA loads for a worker set up without LoRA slots")
            self.lora_slots.load(list(plan.lora_loads))

    def move_blocks(self, plan: worker_pb2.StepPlan) -> None:
        """A plan's block moves, in the order the scheduler relies on: out to the host, in, then copies."""
        self.kv_cache.swap_out([(m.src, m.dst) for m in plan.swap_out])
        self.kv_cache.swap_in([(m.src, m.dst) for m in plan.swap_in])
        self.kv_cache.copy([(m.src, m.dst) for m in plan.copy])
        if self.draft is not None:
            self.draft.pool.move_blocks(plan)

    def execute(self, batch: PersistentBatch, inputs: StepInputs,
                previous_sampled: torch.Tensor | None) -> StepOutput:
        """Queues a prepared step's forward pass (`previous_sampled`: the sampled ids of the step in flight,
        which this step's pending input tokens are taken from) and the sampling rows' logits."""
        if self.lora_slots is not None and inputs.lora_token_slots is not None:
            self.lora_slots.wait_for_loads(inputs.lora_token_slots)  # loaded on their own stream
        hidden = self.graphs.forward(inputs, previous_sampled)
        if self.draft is not None:
            hidden = self.draft.mirror(inputs, previous_sampled, hidden)
        logits = None
        if len(inputs.sample_rows):
            logits = self.model.compute_logits(hidden[to_device(inputs.logits_indices, self.device, torch.long)])
        scored = []
        if (batch.num_prompt_logprobs[inputs.rows] >= 0).any():
            scored = prompt_logprobs(self.model.compute_logits, hidden, batch, inputs)
        return StepOutput(logits, scored)

    def after_sampling(self, batch: PersistentBatch) -> None:
        """Once a step's tokens are written into the rows: an EAGLE head's K/V of the step (eagle_head.py)."""
        if self.draft is not None:
            self.draft.after_sampling(batch)

    @property
    def allows_overlap(self) -> bool:
        """Whether a step may launch before the previous one's tokens reach the host (not with an EAGLE head)."""
        return self.draft is None or self.draft.allows_overlap

    def propose_drafts(self, batch: PersistentBatch, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The draft model's up to `k` greedy tokens after each of `rows`' known tokens (rows that sampled their
        newest token in the step just finished): each row's count and the tokens, row after row
        (`DraftModel.propose`)."""
        if self.draft is None or k > self.draft.num_speculative_tokens:
            raise ValueError(f"a plan asks for {k} draft tokens; this worker's draft model proposes "
                             f"{self.draft.num_speculative_tokens if self.draft else 'none'}")
        return self.draft.propose(batch, rows, k)

    def sampled_drafts(self, batch: PersistentBatch, rows: np.ndarray, offsets: np.ndarray) -> SampledDrafts | None:
        """The draft model's q for a step's draft entries (its draw's `rows` and `offsets`) that it drew from q
        for the row's current tokens (`DraftProbabilities.for_entries`); None without any."""
        if self.draft is None or self.draft.proposed is None:
            return None
        return self.draft.proposed.for_entries(batch, rows, offsets)

    def sample(self, logits: torch.Tensor, tensors: SamplingTensors, masks: tuple[np.ndarray, torch.Tensor] | None,
               drafts: SampledDrafts | None = None) -> DeviceSample:
        """Draws every row of `logits` on the device and starts the step's one device-to-host copy (ids,
        logprobs, any ranks and top-k together). `masks`: the constrained rows' grammar bitmasks (row indices
        into `logits`, bitmask on the host), applied first: vLLM masks at the same point, so logprobs are of the
        masked logits. `drafts`: entries whose drafts a draft model sampled, whose tokens the rejection rule
        gives (sampling/rejection_sampler.py)."""
        if masks is not None:
            self._apply_grammar_masks(logits, *masks)
        out = sample(logits, tensors, self.sampling_ops)
        if drafts is not None:
            out = verify_sampled_drafts(logits, tensors, out, drafts)
        packed = pack_sampler_output(out)
        if not self.on_gpu:
            return DeviceSample(out.token_ids, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = self.device_busy.step_ended() or torch.cuda.Event()
        copied.record()
        return DeviceSample(out.token_ids, host, copied)

    def _apply_grammar_masks(self, logits: torch.Tensor, indices: np.ndarray, bitmask: torch.Tensor) -> None:
        """The disallowed tokens get -inf, in place. The bitmask is filled on the host while the queued forward
        pass runs, then copied without a sync, on its own stream beside the forward pass (queued behind it,
        the copy would delay the draw)."""
        if self._mask_copies is None:
            on_device = to_device(bitmask, self.device, torch.int32)
        else:
            with torch.cuda.stream(self._mask_copies):
                on_device = to_device(bitmask, self.device, torch.int32)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._mask_copies)
            on_device.record_stream(compute)
        self.sampling_ops.apply_token_bitmask(logits, on_device, to_device(indices, self.device, torch.long))

    def top_logprobs(self, logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's `k` best log_softmax values and their token ids, on the host (beam search scores raw
        logprobs, as Hugging Face's does)."""
        logprobs = self.layer_ops.per_row(lambda part: torch.log_softmax(part, dim=-1), logits.float())
        top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1)
        return top.values.cpu().tolist(), top.indices.cpu().tolist()

    def select_rows(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The given rows of `logits` (all of them without a copy)."""
        if len(rows) == logits.shape[0]:
            return logits
        return logits[to_device(rows, self.device, torch.long)]


def _max_proposing_rows(setup: worker_pb2.WorkerSetup) -> int:
    """The most rows a step proposes for: speculation's disable_by_batch_size (0: unset), at most max_num_seqs."""
    return min(setup.draft_model.max_proposing_rows or setup.max_num_seqs, setup.max_num_seqs)


def pack_sampler_output(out: SamplerOutput) -> torch.Tensor:
    """float64 [S, 3 + 2K] on the device: token id, logprob, rank (0 when not computed), K top ids, K top
    logprobs. Ids below 2**53 are exact in float64."""
    columns = [out.token_ids.to(torch.float64).unsqueeze(-1), out.logprobs.to(torch.float64).unsqueeze(-1)]
    if out.ranks is None:
        columns.append(torch.zeros_like(columns[0]))
    else:
        columns += [out.ranks.to(torch.float64).unsqueeze(-1), out.top_ids.to(torch.float64),
                    out.top_logprobs.to(torch.float64)]
    return torch.cat(columns, dim=-1)
