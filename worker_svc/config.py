"""The worker service's one configuration, parsed from its command line in one place (frozen)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

GIB = 1 << 30
# vLLM's --dtype spellings: half is float16, float is float32.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


@dataclass(frozen=True)
class WorkerConfig:
    scheduler_address: str
    model: str | None
    device: str = "cpu"
    # "auto": bfloat16 on a GPU, float32 on the CPU.
    dtype: str = "auto"
    # Set: exactly this many KV blocks. None: sized from memory (gpu_memory_utilization on a GPU,
    # cpu_kv_cache_space on the CPU).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 1.0  # GiB
    swap_space: float = 4.0  # GiB of (pinned) host memory for swapped-out blocks
    # Tensor parallel: this process's rank of `world_size`, and where the ranks meet to form their
    # torch.distributed group (tcp://HOST:PORT that every rank reaches; rank 0 listens there). None: one rank.
    rank: int = 0
    world_size: int = 1
    distributed_init_method: str | None = None
    # "auto": the checkpoint; "dummy": random weights (benchmarks of a model's shape from its config.json).
    load_format: str = "auto"
    # "auto": Triton kernels on a GPU, the torch reference on the CPU.
    attention_backend: str = "auto"
    # Decode steps replay CUDA graphs (GPU only).
    cuda_graphs: bool = True
    # Tensor parallel on CUDA: small all-reduces through symmetric memory instead of NCCL (vLLM's custom
    # all-reduce; worker_svc/symmetric_all_reduce.py).
    custom_all_reduce: bool = True
    # Every op's result for a row independent of the other rows (kernels/batch_invariant_ref.py): a request
    # gives the same bits alone or in any batch, chunked or cached alike.
    batch_invariant: bool = False
    # Seconds between heartbeats to the scheduler; a scheduler silent for 3 of its own intervals is gone.
    heartbeat_interval: float = 2.0
    # Test only: the Nth forward pass raises (a worker fault on demand, across processes). None: never.
    fail_at_step: int | None = None
    # Fault injection: the process exits at once when a new request's tokens hold this id (poison requests).
    crash_on_token_id: int | None = None
    # With crash_on_token_id: exit instead when a row whose prompt holds that id is about to sample its N-th
    # output token (a poison request that crashes mid-decode, again at the same point after a recompute).
    crash_at_output_token: int | None = None
    # Test only: each step takes at least this many seconds per prompt token it computes (a slow CPU's
    # prefill, at a tiny model's cost: the abort-latency tests).
    prefill_seconds_per_token: float = 0.0

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker flags, shared by `pagedserve worker` and `pagedserve serve` (which passes --model itself)."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
                        help="weights and activations (half = float16, float = float32; auto: bfloat16 on a "
                             "GPU, float32 on the CPU)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides sizing)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory for weights, activations and the KV pool")
    parser.add_argument("--cpu-kv-cache-space", type=float, default=1.0, help="GiB of KV pool on the CPU")
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap pool per worker")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of the model's shape (benchmarks)")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto",
                        help="auto: triton on a GPU, the torch reference on the CPU")
    parser.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false",
                        help="run decode steps eagerly on a GPU, without CUDA graphs (vLLM's --enforce-eager)")
    parser.add_argument("--disable-custom-all-reduce", dest="custom_all_reduce", action="store_false",
                        help="tensor parallel: every all-reduce through NCCL, none through symmetric memory "
                             "(vLLM's flag)")
    parser.add_argument("--batch-invariant", action="store_true",
                        default=os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"),
                        help="batch-invariant kernels: a greedy or seeded request gives bitwise the same tokens and "
                             "logprobs whatever else is in the batch (slower; see the README). Default: on when "
                             "$VLLM_BATCH_INVARIANT is set and not 0, as vLLM's switch")
    # Hidden: fault injection for the reliability tests, never for serving.
    parser.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--crash-on-token-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--crash-at-output-token", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prefill-seconds-per-token", type=float, default=0.0, help=argparse.SUPPRESS)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise SystemExit("--num-kv-blocks must be at least 1")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise SystemExit("--gpu-memory-utilization must lie in (0, 1]")
    if args.swap_space < 0 or args.cpu_kv_cache_space <= 0:
        raise SystemExit("--swap-space must be >= 0 and --cpu-kv-cache-space > 0")
    if args.crash_at_output_token is not None and (args.crash_on_token_id is None or args.crash_at_output_token < 1):
        raise SystemExit("--crash-at-output-token needs --crash-on-token-id and must be at least 1")
    if args.heartbeat_interval <= 0:
        raise SystemExit("--heartbeat-interval must be > 0")
    rank, world_size = getattr(args, "rank", 0), getattr(args, "world_size", 1)
    if world_size < 1 or not 0 <= rank < world_size:
        raise SystemExit(f"--rank {rank} is not a rank of --world-size {world_size} (0 <= rank < world size)")
    init_method = getattr(args, "distributed_init_method", None)
    if world_size > 1 and init_method is None:
        raise SystemExit("--world-size > 1 needs --distributed-init-method tcp://HOST:PORT (reachable by every rank)")
    return WorkerConfig(
        scheduler_address=args.scheduler_address,
        model=args.model,
        device=args.device,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_space=args.cpu_kv_cache_space,
        swap_space=args.swap_space,
        rank=rank,
        world_size=world_size,
        distributed_init_method=init_method,
        load_format=args.load_format,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        custom_all_reduce=args.custom_all_reduce,
        batch_invariant=args.batch_invariant,
        heartbeat_interval=args.heartbeat_interval,
        fail_at_step=args.fail_at_step,
        crash_on_token_id=args.crash_on_token_id,
        crash_at_output_token=args.crash_at_output_token,
        prefill_seconds_per_token=args.prefill_seconds_per_token,
    )
