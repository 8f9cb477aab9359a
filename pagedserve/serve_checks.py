"""What `pagedserve serve` refuses (or settles) from its flags and the model's files before any process starts.

Why before: a worker finds an unservable model, adapter, draft or shard only after the scheduler and the gateway
are up, and its refusal then reads as a child's traceback; here each is one line naming the flag, and the hub
downloads (the model, the tokenizer, a draft) happen once, in the launcher, before the children look for them.
`serve` (pagedserve/launcher.py) calls them in order; tests call them alone.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from pagedserve.engine_replicas import data_parallel_refusal
from scheduler_svc.config import lora_flags_refusal
from scheduler_svc.core.speculative_config import EAGLE1_METHOD, EAGLE3_METHOD
from scheduler_svc.generation_defaults import load_generation_defaults
from scheduler_svc.text.chat_template_source import chat_template_text
from service_runtime.lora_modules import adapters_refusal
from service_runtime.model_source import ResolvedModel, resolve_model
from worker_svc.model_config import ModelConfig, find_gguf_file
from worker_svc.models.eagle1_config import eagle1_refusal
from worker_svc.models.eagle3_config import eagle3_refusal
from worker_svc.tensor_parallel_fit import draft_refusal, first_gpu_index, gpus_refusal, shard_refusal


def refuse_bad_text_options(args, model_path: str) -> None:
    """Exits naming the flag if --quantization, --chat-template or --[override-]generation-config cannot be
    honoured, before any child starts; resolves --tokenizer (a hub download happens once, here)."""
    if args.quantization == "gguf" and not model_path.endswith(".gguf"):
        raise SystemExit(f"pagedserve: --quantization gguf: {model_path} is not a .gguf file")
    try:
        if args.chat_template is not None:
            chat_template_text(args.chat_template)
        load_generation_defaults(args.generation_config, model_path, args.override_generation_config)
    except ValueError as error:
        raise SystemExit(f"pagedserve: {error}") from None
    if args.tokenizer is not None:
        args.tokenizer = resolve_model(args.tokenizer).path


def resolve_servable_model(args) -> ResolvedModel:
    """The model's local files, or an exit with one line (no traceback) if the worker would refuse it: an
    unknown --model, an architecture or config feature we do not serve, a checkpoint without weights. Why
    here: found by the worker, it would surface as the worker's traceback after the scheduler and the
    gateway had already started."""
    try:
        model = resolve_model(args.model)
        config = ModelConfig.from_path(model.path, args.quantization)
    except (ValueError, RuntimeError, OSError) as error:
        raise SystemExit(f"pagedserve: cannot serve {args.model or 'the default model'}: {error}") from None
    if config.quantization is not None and args.batch_invariant:
        raise SystemExit(f"pagedserve: cannot serve {model.name} with --batch-invariant: "
                         f"{config.quantization.describe()} has no batch-invariant matmul")
    weightless = find_gguf_file(model.path) is None and not any(Path(model.path).glob("*.safetensors"))
    if weightless and args.load_format != "dummy":
        raise SystemExit(f"pagedserve: cannot serve {model.name}: no .safetensors weights in {model.path} "
                         f"(its config says {config.architecture}; --load-format dummy serves random weights)")
    return model


def refuse_unservable_adapters(args) -> None:
    """LoRA (docs/lora.md): the flags' combinations, and each adapter of --lora-modules read once, before any child
    starts (a worker would refuse them later, but only after loading the model; it still checks the adapters'
    tensors against the model)."""
    refusal = lora_flags_refusal(args.enable_lora, tuple(args.lora_modules or ()), args.max_loras, args.max_lora_rank,
                                 args.max_cpu_loras, args.speculative_config is not None,
                                 args.allow_runtime_lora_updating)
    if refusal is not None:
        raise SystemExit(f"pagedserve: {refusal}")
    if args.enable_lora and args.batch_invariant:
        raise SystemExit("pagedserve: --enable-lora cannot go with --batch-invariant (the LoRA deltas do not run "
                         "on the batch-invariant kernels)")
    if args.enable_lora:
        refusal = adapters_refusal(tuple(args.lora_modules or ()), args.max_lora_rank)
        if refusal is not None:
            raise SystemExit(f"pagedserve: --lora-modules: {refusal}")


def resolve_draft_model(args, model_path: str) -> None:
    """Speculative decoding with a draft model: its local files (a hub download happens once, here; the
    scheduler and the workers get the path), or an exit with one line if the workers would refuse it beside
    this target: an unservable checkpoint, a smaller vocabulary or context, heads that do not split over the ranks, or
    a draft_tensor_parallel_size other than the target's."""
    speculative = args.speculative_config
    if speculative is None or not speculative.uses_draft_model:
        return
    refusal = speculative.tensor_parallel_refusal(args.tensor_parallel_size)
    if refusal is None:
        try:
            draft = resolve_model(speculative.model)
            target = ModelConfig.from_path(model_path, args.quantization)
            if speculative.method == EAGLE3_METHOD:
                refusal = eagle3_refusal(draft.path, target, args.tensor_parallel_size)
            elif speculative.method == EAGLE1_METHOD:
                refusal = eagle1_refusal(draft.path, target, args.tensor_parallel_size)
            else:
                refusal = draft_refusal(ModelConfig.from_path(draft.path), target, args.tensor_parallel_size,
                                        args.max_model_len)
        except (ValueError, RuntimeError, OSError) as error:
            refusal = f"cannot serve the draft model {speculative.model}: {error}"
    if refusal is not None:
        raise SystemExit(f"pagedserve: --speculative-config: {refusal}")
    args.speculative_config = dataclasses.replace(speculative, model=draft.path)


def refuse_unfit_tensor_parallel(args, model_path) -> None:
    """Exits naming --tensor-parallel-size if the model's heads or this host's visible GPUs do not allow it
    (with Ray the ranks' GPUs are the cluster's: its placement group refuses what it cannot place)."""
    size = args.tensor_parallel_size
    if size == 1:
        return
    refusal = shard_refusal(ModelConfig.from_path(model_path), size)
    if refusal is None and args.device.startswith("cuda") and args.distributed_executor_backend == "mp":
        import torch  # only here: the launcher otherwise never needs it

        refusal = gpus_refusal(size, first_gpu_index(args.device), torch.cuda.device_count())
    if refusal is not None:
        raise SystemExit(f"pagedserve: {refusal}")


def refuse_unfit_data_parallel(args) -> None:
    """Exits naming --data-parallel-size if its engines cannot start here (engine_replicas.py says why)."""
    visible = None
    if args.data_parallel_size > 1 and args.device.startswith("cuda"):
        import torch  # only here: the launcher otherwise never needs it

        visible = torch.cuda.device_count()
    refusal = data_parallel_refusal(args, visible)
    if refusal is not None:
        raise SystemExit(f"pagedserve: {refusal}")


def keep_prefix_cache_exact(args, model_path) -> None:
    """Turns prefix caching off for a longrope model (Phi-3's 128k variants): its cached keys are rotated with
    the short or the long factors depending on the length of the sequence that computed them
    (worker_svc/layers/rotary_embedding.py), so another sequence could reuse keys of the other set."""
    if not args.enable_prefix_caching:
        return
    try:
        scaling = ModelConfig.from_path(model_path).rope_scaling_params()
    except (ValueError, FileNotFoundError) as error:  # a model we cannot serve: one line, before any child
        raise SystemExit(f"pagedserve: {error}") from None
    if scaling is not None and scaling["rope_type"] == "longrope":
        print("pagedserve: prefix caching is off for this model: its longrope keys depend on the sequence's length",
              file=sys.stderr, flush=True)
        args.enable_prefix_caching = False
