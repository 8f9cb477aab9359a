"""The worker process: owns the model, the KV and swap pools and the persistent batch; runs the plans.

It never decides anything: each `StepPlan` says which rows to drop, which blocks to move, which tokens to
compute; the worker executes it and answers with the sampled tokens. Its state is a pure function of the
plans received, so a plan log replays a bug. The process's loop around it (the link to the scheduler,
overlapping steps, failures) is serving_loop.py.

Tensor parallel (`--world-size N`, one process per rank): every rank receives every plan and runs every step
the same way: the same row updates, block moves and forward pass (whose layers talk to the other ranks
through the `TensorParallel` group, joined here before the model loads), and the same sampling. Why every
rank samples instead of rank 0 broadcasting its tokens: the logits are gathered whole to every rank by the
model's vocab-parallel head and every request's randomness is keyed by its (seed, position), which the
scheduler always sets, so each rank draws the same tokens without a collective; the persistent batch's next
input token (a decode's own last sample, on the device, possibly still in flight) is therefore already on
every rank. So only rank 0 sends each step's result; the other ranks send nothing per step but heartbeats,
and a WorkerError if a step fails on them. The ranks agree on one KV pool size (the smallest) at setup.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.sampling_ops import batch_invariant_sampling_ops, torch_sampling_ops, triton_sampling_ops
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.model_source import resolve_model
from service_runtime.step_timer import BackToBackClock, StepTimer
from worker_svc.attention_choice import kernel_set, make_attention_backend, make_layer_ops
from worker_svc.compile_watch import warn_on_compiles_while_serving
from worker_svc.config import GIB, WorkerConfig
from worker_svc.decode_graphs import DecodeGraphs, take_pending_tokens
from worker_svc.device_busy import DeviceBusyClock
from worker_svc.grammar_matchers import GrammarMatchers, mask_threads
from worker_svc.host_to_device import to_device
from worker_svc.kernel_warmup import warm_up_kernels
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.kv_cache_sizing import num_kv_blocks
from worker_svc.layers.attention import Attention
from worker_svc.mixed_graphs import MixedGraphs, supports_mixed_graphs
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model, refused_as_load_refusal
from worker_svc.persistent_batch import PendingTokens, PersistentBatch
from worker_svc.sampling.logits_processors import LogitsAdjustments, SparseLogits
from worker_svc.sampling.prompt_logprobs import prompt_logprobs
from worker_svc.sampling.sampler import SamplerOutput, SamplingTensors, sample
from worker_svc.sampling.sampling_inputs import build_sampling_tensors
from worker_svc.tensor_parallel import init_tensor_parallel
from worker_svc.tensor_parallel_fit import shard_refusal

logger = logging.getLogger(__name__)

# A step whose launch takes longer is logged (its host work, not its GPU time).
_SLOW_LAUNCH_S = 0.25


class InjectedFault(RuntimeError):
    """The failure `--fail-at-step` asks for: tests prove what a forward pass that raises does to the service."""


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        model = resolve_model(config.model)
        if config.world_size > 1:
            # Before joining the group: every rank refuses alike, none waits for the others.
            with refused_as_load_refusal():
                model_config = ModelConfig.from_path(model.path)
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
            layer_ops=self.layer_ops, load_format=config.load_format, tensor_parallel=self.tensor_parallel)
        self.model_name = model.name
        self.kv_cache: KVCache | None = None
        self.batch: PersistentBatch | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.step_timer = StepTimer(f"worker rank {config.rank}")
        self.gpu_clock = BackToBackClock()
        self.device_busy = DeviceBusyClock(enabled=self.device.type == "cuda")
        self.num_forward_passes = 0  # counts towards config.fail_at_step (fault-injection tests)
        # Grammar bitmasks (5 MB a step for 256 rows of a 152k vocabulary) go up on a stream of their own.
        self._mask_copies = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # On a GPU each sampler pass is one Triton kernel (kernels/sampling_ops.py).
        self.sampling_ops = triton_sampling_ops() if self.device.type == "cuda" else torch_sampling_ops()
        if config.batch_invariant:
            self.sampling_ops = batch_invariant_sampling_ops(self.sampling_ops)

    def setup(self, setup: worker_pb2.WorkerSetup) -> worker_pb2.WorkerReady:
        """Sizes and allocates the pools; every rank allocates the same number of blocks (the smallest any
        rank can hold: the scheduler's block ids must mean the same slots on every rank)."""
        tensor_parallel = self.tensor_parallel
        blocks = num_kv_blocks(self.config, self.model, self.model_config, setup.block_size,
                               setup.max_num_batched_tokens, setup.max_num_seqs, setup.max_model_len,
                               self.dtype, self.device, tensor_parallel)
        swap_blocks = int(self.config.swap_space * GIB) // bytes_per_block(self.model_config, setup.block_size,
                                                                          self.dtype, tensor_parallel)
        blocks = tensor_parallel.all_reduce_min(blocks, self.device)
        swap_blocks = tensor_parallel.all_reduce_min(swap_blocks, self.device)
        self.kv_cache = KVCache(self.model_config, blocks, swap_blocks, setup.block_size, self.dtype, self.device,
                                tensor_parallel)
        grammars = GrammarMatchers(setup.structured_output_tokenizer if setup.HasField("structured_output_tokenizer")
                                   else None, self.model_config.vocab_size, setup.max_num_seqs,
                                   pin_memory=self.device.type == "cuda",
                                   num_threads=mask_threads(self.config.world_size),
                                   limits=setup.structured_output_limits
                                   if setup.HasField("structured_output_limits") else None)
        self.batch = PersistentBatch(setup.max_num_seqs, setup.max_model_len, setup.block_size, grammars)
        if self.device.type == "cuda":
            self._warm_up_sampler()
        if self.device.type == "cuda" and kernel_set(self.config) == "triton":
            warm_up_kernels(self.model, self.kv_cache.layers, setup.block_size, self.batch.block_table.shape[1],
                            setup.max_num_seqs, self.device)
        if self.device.type == "cuda" and self.config.cuda_graphs:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache.layers, setup.max_num_seqs,
                                              self.batch.block_table.shape[1], setup.block_size, self.device)
            self.decode_graphs.capture()
            self.mixed_graphs = self._capture_mixed_graphs(setup.block_size)
        if self.device.type == "cuda":
            warn_on_compiles_while_serving()
        logger.info("rank %d: %d KV blocks, %d swap blocks", self.config.rank, blocks, swap_blocks)
        return worker_pb2.WorkerReady(rank=self.config.rank, num_kv_blocks=blocks, num_swap_blocks=swap_blocks)

    def _capture_mixed_graphs(self, block_size: int) -> MixedGraphs | None:
        """Piecewise graphs for steps with prefill where the model allows (worker_svc/mixed_graphs.py); None
        there, and where their memory pool does not fit beside the KV pool (then those steps run eagerly)."""
        attention = [module for module in self.model.modules() if isinstance(module, Attention)]
        if not attention or not supports_mixed_graphs(self.model, self.config.world_size, attention[0].backend):
            return None
        graphs = MixedGraphs(self.model, self.kv_cache.layers, attention, attention[0].backend, block_size,
                             self.device)
        torch.cuda.empty_cache()  # the memory profile's activations: the graphs' pool is allocated apart
        try:
            graphs.capture()
        except torch.cuda.OutOfMemoryError:
            logger.warning("rank %d: no memory left for CUDA graphs of steps with prefill; they run eagerly "
                           "(a lower --gpu-memory-utilization leaves room)", self.config.rank)
            torch.cuda.empty_cache()
            return None
        return graphs

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Compiles every variant of the sampler's kernels (greedy, drawn, restricted, with processed logits,
        each logprobs buffer size up to 32 logprobs, each top-k size class, the grammar mask) for one row and
        for several before serving, not at a request's first sampled token."""
        vocab_size = self.model_config.vocab_size
        bias = LogitsAdjustments(sparse=SparseLogits(rows=torch.zeros(1, dtype=torch.int64, device=self.device),
                                                     token_ids=torch.zeros(1, dtype=torch.int64, device=self.device),
                                                     values=torch.ones(1, device=self.device)))
        for rows, temperature, top_k, adjustments, logprobs in itertools.product(
                (1, 2), (0.0, 1.0), (-1, 5), (None, bias), (-1, 0, 8, 16, 32)):
            tensors = SamplingTensors.from_host(temperature=[temperature] * rows, top_p=[0.9] * rows,
                                                top_k=[top_k] * rows, seed=[0] * rows, position=[0] * rows,
                                                adjustments=adjustments, num_top_logprobs=logprobs, device=self.device)
            sample(torch.zeros(rows, vocab_size, device=self.device), tensors, self.sampling_ops)
        # The grammar mask (constrained rows) has one variant.
        no_tokens = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32, device=self.device)
        self.sampling_ops.apply_token_bitmask(torch.zeros(1, vocab_size, device=self.device), no_tokens,
                                              torch.zeros(1, dtype=torch.int64, device=self.device))
        from kernels.triton_kth_largest import MAX_FILTERED_K  # Triton only on a GPU

        # The top-k filter's group size and buffers follow the batch's largest k: one compile per size class.
        for top_k in (2 ** i for i in range(1, MAX_FILTERED_K.bit_length())):
            tensors = SamplingTensors.from_host(temperature=[1.0], top_p=[1.0], top_k=[top_k], seed=[0], position=[0],
                                                device=self.device)
            sample(torch.randn(1, vocab_size, device=self.device), tensors, self.sampling_ops)

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """Runs one step and returns its result (`launch`, then `finish`)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: worker_pb2.StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Applies a plan to the rows and queues the step's work on the device without waiting for it.

        `previous`, a step launched and not finished yet: the GPU runs the two back to back, and this step's
        inputs that are tokens `previous` samples are taken from its sampled ids on the device (the rows hold
        them as PENDING_TOKEN until `finish(previous)`). The caller finishes `previous` first when
        `can_overlap(plan)` is False.
        """
        batch, kv_cache, timer = self.batch, self.kv_cache, self.step_timer
        if previous is not None and previous.masks is None:
            self.complete(previous)  # a deferred draw reads its rows' matchers: before this plan changes them
        timer.start_step()
        started = time.perf_counter()
        for request_id in plan.finished_request_ids:
            batch.remove(request_id)
        for request_id in plan.preempted_request_ids:
            batch.remove(request_id)
        kv_cache.swap_out([(m.src, m.dst) for m in plan.swap_out])
        kv_cache.swap_in([(m.src, m.dst) for m in plan.swap_in])
        kv_cache.copy([(m.src, m.dst) for m in plan.copy])
        if self.config.crash_on_token_id is not None and self.config.crash_at_output_token is None and any(
                self.config.crash_on_token_id in new.token_ids for new in plan.new_requests):
            os._exit(70)  # a hard crash tied to one request (a poison request), for the recovery tests
        if batch.grammars is not None:
            batch.grammars.prepare([new.sampling.structured_grammar for new in plan.new_requests
                                    if new.sampling.structured_grammar])
        rows = [batch.add(new) for new in plan.new_requests]
        rows += [batch.update(scheduled) for scheduled in plan.scheduled_requests]
        step = LaunchedStep(worker_pb2.StepResult(step_id=plan.step_id), behind_another=previous is not None,
                            started=self.device_busy.step_started())
        if not rows:
            return step
        num_scheduled = [n.num_scheduled_tokens for n in plan.new_requests]
        num_scheduled += [s.num_scheduled_tokens for s in plan.scheduled_requests]
        rows_array, scheduled_array = np.asarray(rows, dtype=np.int64), np.asarray(num_scheduled, dtype=np.int64)
        # Decodes (one token) first: attention backends run them with their own kernel over a leading range.
        order = np.argsort(scheduled_array != 1, kind="stable")
        inputs = batch.build_inputs(rows_array[order], scheduled_array[order])
        step.kind = "decode" if inputs.num_decode_seqs == len(inputs.rows) else "with prefill"
        # The timers split constrained steps from the others: what a grammar costs a step, in one engine.
        step.timed_as = step.kind + (" constrained" if batch.grammars is not None and batch.grammars.constrained[
            inputs.sample_rows].any() else "")
        timer.set_kind(step.timed_as)
        if self.config.crash_at_output_token is not None and self._samples_poisoned_output(inputs.sample_rows):
            os._exit(70)  # a poison request that crashes mid-decode, at the same point after every recompute
        if self.config.prefill_seconds_per_token:  # a slow prefill on demand (tests)
            time.sleep(self.config.prefill_seconds_per_token * (len(inputs.input_ids) - inputs.num_decode_seqs))
        timer.mark("prepare")
        if previous is not None and self.draw_pending(previous):
            self.complete(previous)  # its draw goes on the stream before this forward pass
            timer.mark("draw_behind")  # mostly the wait for its grammar masks
        hidden = self._forward(inputs, previous.sampled_ids if previous is not None else None)
        logits = self._logits(hidden, inputs)
        timer.mark("forward_launch")
        if (batch.num_prompt_logprobs[inputs.rows] >= 0).any():
            step.result.prompt_logprobs.extend(prompt_logprobs(self.model.compute_logits, hidden, batch, inputs))
        is_beam = batch.num_beam_candidates[inputs.sample_rows] > 0
        step.sampled_rows = inputs.sample_rows[~is_beam]
        if len(step.sampled_rows):
            # Who sampled, as of now: a row may be handed to another request before the step finishes.
            step.request_ids = [batch.request_id_of(row) for row in step.sampled_rows.tolist()]
            step.num_logprobs = batch.num_logprobs[step.sampled_rows].copy()
            # The sampling inputs as of now (a row's seed position is its token count before begin_step).
            tensors = build_sampling_tensors(batch, step.sampled_rows, self.device)
            if previous is not None and batch.grammars is not None and batch.grammars.follows_sampled_tokens(
                    step.sampled_rows):
                # A grammar's mask needs the token `previous` samples (a waiting grammar: whether it starts):
                # queued forward first, the mask and the draw once `previous` is finished (`complete`), still
                # while this step's forward runs.
                step.deferred_sample = partial(self._sample, logits, np.flatnonzero(~is_beam), step, tensors)
            else:
                self._sample(logits, np.flatnonzero(~is_beam), step, tensors)
        pending = batch.begin_step(inputs, step.sampled_rows)
        step.pending = pending if len(step.sampled_rows) else None
        if is_beam.any():
            step.result.beam_candidates.extend(self._beam_candidates(logits, np.flatnonzero(is_beam),
                                                                     inputs.sample_rows[is_beam]))
        timer.mark("sample_launch")
        elapsed = time.perf_counter() - started
        # On a GPU a launch only queues kernels, so a slow one means the host was slow (a compile of a kernel
        # variant seen first?); on the CPU the launch is the computation itself, slow by nature: not logged.
        if self.device.type == "cuda" and elapsed > _SLOW_LAUNCH_S:
            logger.info("slow step launch: %.2f s for %d tokens, %d decodes, %d chunks", elapsed,
                        len(inputs.input_ids), inputs.num_decode_seqs, len(inputs.rows) - inputs.num_decode_seqs)
        return step

    def _samples_poisoned_output(self, sample_rows: np.ndarray) -> bool:
        """Whether a row about to sample holds the crash token in its prompt and would sample its
        `crash_at_output_token`-th output token (its known tokens, pending ones included, count one less)."""
        batch, config = self.batch, self.config
        for row in sample_rows.tolist():
            num_prompt = int(batch.num_prompt_tokens[row])
            if (batch.num_tokens[row] - num_prompt + 1 == config.crash_at_output_token
                    and config.crash_on_token_id in batch.token_ids[row, :num_prompt]):
                return True
        return False

    def begin_masks(self, step: LaunchedStep) -> None:
        """Starts filling the grammar masks of a step's deferred draw on llguidance's threads (see `launch`);
        call it once the step it was launched behind is finished. The caller prepares the next step
        meanwhile, and `complete` (the next `launch` calls it before its forward pass) takes the masks."""
        if step.deferred_sample is not None and step.masks is None and self.batch.grammars is not None:
            step.masks = self.batch.grammars.bitmask_in_background(step.sampled_rows)

    def draw_pending(self, step: LaunchedStep) -> bool:
        """Whether a step's deferred draw is not on the device yet (`complete` puts it there)."""
        return step.deferred_sample is not None

    @torch.inference_mode()
    def complete(self, step: LaunchedStep) -> None:
        """Launches a step's deferred draw (constrained rows launched behind another step: see `launch`); call it
        once the step it was launched behind is finished. Nothing to do for any other step."""
        if step.deferred_sample is not None:
            deferred, step.deferred_sample = step.deferred_sample, None
            deferred()

    def finish(self, step: LaunchedStep) -> worker_pb2.StepResult:
        """Waits for a launched step's sampled tokens, writes them into the rows, returns its result."""
        self.complete(step)
        timer = self.step_timer
        timer.resume(step.timed_as)
        if step.copied is not None:  # set where rows sampled on a GPU
            step.copied.synchronize()
        self.device_busy.on_finished(step.kind, step.started, step.copied)
        if step.pending is not None:
            self.gpu_clock.on_finished(step.timed_as, step.behind_another)
            sampled = step.host_sampled.numpy()
            step.result.failed_requests.extend(self.batch.fill(step.pending, sampled[:, 0].astype(np.int64)))
            timer.mark("wait_for_gpu")
            step.result.sampled.CopyFrom(self._sampled_tokens(step, sampled))
        timer.mark("result")
        return step.result

    def grammar_summary(self) -> str:
        """The grammar masks' timing (`GrammarTiming`) for the shutdown log, '' without constrained rows."""
        grammars = self.batch.grammars if self.batch is not None else None
        summary = grammars.timing.summary() if grammars is not None else ""
        return f"; {summary}" if summary else ""

    def can_overlap(self, plan: worker_pb2.StepPlan) -> bool:
        """Whether `plan` may be launched before the step in flight finishes: not when a row it samples reads
        its own earlier tokens on the host (penalties, bad words, logit bias or min_tokens masks), since the
        token in flight is not there yet. A grammar's row may: its draw waits for that token (`complete`)."""
        batch = self.batch
        for scheduled in plan.scheduled_requests:
            row = batch.row_of(scheduled.request_id)
            if batch.reads_history(row):
                return False
        return True

    def _forward(self, inputs, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        """Runs the model over every scheduled token; returns the hidden states, one row per token."""
        device, batch = self.device, self.batch
        self.num_forward_passes += 1
        if self.num_forward_passes == self.config.fail_at_step:
            raise InjectedFault(f"forward pass {self.num_forward_passes} failed on purpose (--fail-at-step)")
        bucket = self.decode_graphs.bucket_for(inputs) if self.decode_graphs is not None else None
        if bucket is not None:
            hidden = self.decode_graphs.run(inputs, bucket, previous_sampled)
        else:
            metadata = AttentionMetadata(
                slot_mapping=_to_device(inputs.slot_mapping, torch.long, device),
                query_start_loc=_to_device(inputs.query_start_loc, torch.int32, device),
                seq_lens=_to_device(inputs.seq_lens, torch.int32, device),
                block_tables=_to_device(inputs.block_tables, torch.int32, device),
                block_size=batch.block_size,
                num_decode_seqs=inputs.num_decode_seqs,
            )
            input_ids = _to_device(inputs.input_ids, torch.long, device)
            if len(inputs.pending_input_indices):
                take_pending_tokens(input_ids, inputs, previous_sampled)
            size = self.mixed_graphs.bucket_for(len(inputs.input_ids)) if self.mixed_graphs is not None else None
            if size is not None:
                return self.mixed_graphs.run(input_ids, inputs.positions, metadata, inputs.slot_mapping, size)
            hidden = self.model(input_ids, _to_device(inputs.positions, torch.long, device), self.kv_cache.layers,
                                metadata)
        return hidden

    def _logits(self, hidden: torch.Tensor, inputs) -> torch.Tensor | None:
        """The logits of the rows that sample (or return beam candidates), or None."""
        if len(inputs.sample_rows) == 0:
            return None
        return self.model.compute_logits(hidden[_to_device(inputs.logits_indices, torch.long, self.device)])

    def _sample(self, logits, logits_rows: np.ndarray, step: LaunchedStep, tensors) -> None:
        """Samples the step's sampled rows on the device and starts the step's one device-to-host copy: ids,
        logprobs and any ranks and top-k travel together, float64 [S, 3 + 2K] (see `pack_sampler_output`)."""
        if len(logits_rows) != logits.shape[0]:
            logits = logits[_to_device(logits_rows, torch.long, self.device)]
        self._mask_by_grammar(logits, step)
        out = sample(logits, tensors, self.sampling_ops)
        step.sampled_ids = out.token_ids
        packed = pack_sampler_output(out)
        if self.device.type == "cuda":
            step.host_sampled = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            step.host_sampled.copy_(packed, non_blocking=True)
            step.copied = self.device_busy.step_ended() or torch.cuda.Event()
            step.copied.record()
        else:
            step.host_sampled = packed

    def _mask_by_grammar(self, logits: torch.Tensor, step: LaunchedStep) -> None:
        """Constrained rows: the tokens their grammar disallows get -inf, in place, before the logits processors
        and sampling (vLLM applies the grammar bitmask at the same point, so logprobs are of the masked logits).
        The bitmask is filled on the host while the queued forward pass runs (from `begin_masks`, if called),
        then copied without a sync."""
        if step.masks is not None:
            waited = time.perf_counter()
            masks, step.masks = step.masks.result(), None
            if masks is not None:
                self.batch.grammars.timing.add("wait", len(masks[0]), time.perf_counter() - waited)
        else:
            masks = self.batch.grammars.bitmask(step.sampled_rows) if self.batch.grammars is not None else None
        if masks is None:
            return
        indices, bitmask = masks
        if self._mask_copies is None:
            on_device = _to_device(bitmask, torch.int32, self.device)
        else:  # on its own stream, beside the forward pass (queued behind it, the copy would delay the draw)
            with torch.cuda.stream(self._mask_copies):
                on_device = _to_device(bitmask, torch.int32, self.device)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self._mask_copies)
            on_device.record_stream(compute)
        self.sampling_ops.apply_token_bitmask(logits, on_device, _to_device(indices, torch.long, self.device))

    @staticmethod
    def _sampled_tokens(step: LaunchedStep, sampled: np.ndarray) -> worker_pb2.SampledTokens:
        """The step's sampled rows as parallel lists: whole-column numpy, no loop over the rows."""
        k = (sampled.shape[1] - 3) // 2
        num_top = np.clip(step.num_logprobs, 0, k)
        top = np.arange(k) < num_top[:, None]  # each row's first num_top columns, row after row
        return worker_pb2.SampledTokens(
            request_ids=step.request_ids, token_ids=sampled[:, 0].astype(np.int64).tolist(),
            logprobs=sampled[:, 1].tolist(), ranks=np.where(step.num_logprobs >= 0, sampled[:, 2], 0).astype(np.int64).tolist(),
            num_top=num_top.tolist(), top_token_ids=sampled[:, 3 : 3 + k][top].astype(np.int64).tolist(),
            top_logprobs=sampled[:, 3 + k :][top].tolist())

    def _beam_candidates(self, logits, logits_rows: np.ndarray, rows: np.ndarray) -> list[worker_pb2.BeamCandidates]:
        """Top log_softmax candidates of each beam row (Hugging Face beam search scores raw logprobs)."""
        batch = self.batch
        counts = batch.num_beam_candidates[rows]
        beam_logits = logits[_to_device(logits_rows, torch.long, self.device)].float()
        logprobs = self.layer_ops.per_row(lambda part: torch.log_softmax(part, dim=-1), beam_logits)
        top = torch.topk(logprobs, k=int(min(counts.max(), logprobs.shape[-1])), dim=-1)
        values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
        return [
            worker_pb2.BeamCandidates(
                request_id=batch.request_id_of(row),
                candidates=[worker_pb2.TokenCandidate(token_id=t, logprob=v) for t, v in zip(ids[:k], vals[:k])],
            )
            for row, k, ids, vals in zip(rows.tolist(), counts.tolist(), indices, values)
        ]


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


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(array, device, dtype)


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens have not been read back (see `Worker.launch`).

    Why a record rather than a blocking call: the worker launches step N+1 before it waits for step N, so
    the GPU always has the next step queued while the host reads results and builds inputs. It holds what
    `finish` needs: the result built so far, the rows that sample, their pending tokens in the batch, the
    sampled ids on the device (inputs of the next step), and the pinned host copy with its event.
    """

    result: worker_pb2.StepResult
    behind_another: bool = False  # launched while another step was in flight
    kind: str = "decode"
    timed_as: str = "decode"  # the kind, and whether rows are constrained (the step timers' split)
    sampled_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    request_ids: list[str] = field(default_factory=list)  # of sampled_rows, at launch
    num_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending: PendingTokens | None = None
    sampled_ids: torch.Tensor | None = None
    host_sampled: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    started: torch.cuda.Event | None = None  # before the step's first device work, when timed (device_busy.py)
    # Launched behind another step with constrained rows: the mask and draw, run by `Worker.complete`.
    deferred_sample: Callable[[], None] | None = None
    masks: Future | None = None  # the deferred draw's grammar masks, filling (`Worker.begin_masks`)
