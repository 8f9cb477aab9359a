"""The worker service's one configuration (frozen). Each field declares its own flag (service_runtime/
config_flags.py): `pagedserve worker` parses them all, `pagedserve serve` takes the shared ones and forwards
them to each rank from this declaration (pagedserve/launcher.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from service_runtime.config_flags import add_config_arguments, flag, flag_values, shared_flag_field
from service_runtime.worker_link_flags import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_WORKER_ADDRESS, HEARTBEAT_INTERVAL
from worker_svc.cpu_placement import bind_value
from worker_svc.quantization_config import QUANTIZATION_FLAG_VALUES

GIB = 1 << 30
# vLLM's --dtype spellings: half is float16, float is float32.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# --kv-cache-dtype values we serve (kernels/kv_quant.py): the model's dtype, or fp8 e4m3 (vLLM's "fp8").
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_dtype_name(value: str) -> str:
    """--kv-cache-dtype's value, refusing vLLM's others (fp8_e5m2, fp8_inc, ...) with the ones we serve."""
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)} "
                                         "(auto: the model's dtype; fp8 = fp8_e4m3, docs/kv_cache_fp8.md)")
    return value


@dataclass(frozen=True)
class WorkerConfig:
    # `serve` passes --model itself (the one model both children load) and each rank's address and place.
    model: str | None = flag("--model", default=None, help="model directory, .gguf file or hub id", shared=False)
    scheduler_address: str = flag("--scheduler-address", default=DEFAULT_WORKER_ADDRESS,
                                  help="ZeroMQ address to connect", shared=False)
    device: str = flag("--device", default="cpu", help="cpu, cuda or cuda:N")
    # "auto": bfloat16 on a GPU, float32 on the CPU.
    dtype: str = flag("--dtype", default="auto", choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
                      help="weights and activations (half = float16, float = float32; auto: bfloat16 on a "
                           "GPU, float32 on the CPU)")
    # The KV pool's dtype: the model's ("auto") or float8_e4m3fn with per-layer scales (half the bytes a block).
    kv_cache_dtype: str = flag("--kv-cache-dtype", default="auto", parse=kv_cache_dtype_name,
                               help="KV cache dtype: auto (the model's dtype) or fp8 (= fp8_e4m3: float8 e4m3 with the "
                                    "checkpoint's per-layer k/v scales, else 1.0; twice the blocks)")
    # Set: exactly this many KV blocks. None: sized from memory (gpu_memory_utilization on a GPU,
    # cpu_kv_cache_space on the CPU).
    num_kv_blocks: int | None = flag("--num-kv-blocks", default=None, help="KV pool size in blocks (overrides sizing)")
    gpu_memory_utilization: float = flag("--gpu-memory-utilization", default=0.9,
                                         help="fraction of GPU memory for weights, activations and the KV pool")
    cpu_kv_cache_space: float = flag("--cpu-kv-cache-space", default=1.0, help="GiB of KV pool on the CPU")
    # GiB of (pinned) host memory for swapped-out blocks.
    swap_space: float = flag("--swap-space", default=4.0, help="GiB of host swap pool per worker")
    # "auto": the checkpoint; "dummy": random weights (benchmarks of a model's shape from its config.json).
    load_format: str = flag("--load-format", default="auto", choices=("auto", "dummy"),
                            help="dummy: random weights of the model's shape (benchmarks)")
    # "auto": Triton kernels on a GPU, the torch reference on the CPU.
    attention_backend: str = flag("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                                  help="auto: triton on a GPU, the torch reference on the CPU")
    # Decode steps replay CUDA graphs (GPU only).
    cuda_graphs: bool = flag("--no-cuda-graphs", "--enforce-eager", default=True, switch="off",
                             help="run decode steps eagerly on a GPU, without CUDA graphs (vLLM's --enforce-eager)")
    # Tensor parallel on CUDA: small all-reduces through symmetric memory instead of NCCL (vLLM's custom
    # all-reduce; worker_svc/symmetric_all_reduce.py).
    custom_all_reduce: bool = flag("--disable-custom-all-reduce", default=True, switch="off",
                                   help="tensor parallel: every all-reduce through NCCL, none through symmetric "
                                        "memory (vLLM's flag)")
    # Every op's result for a row independent of the other rows (kernels/batch_invariant_ref.py): a request
    # gives the same bits alone or in any batch, chunked or cached alike.
    batch_invariant: bool = flag("--batch-invariant", default=False, switch="on",
                                 env_switch="VLLM_BATCH_INVARIANT",
                                 help="batch-invariant kernels: a greedy or seeded request gives bitwise the same "
                                      "tokens and logprobs whatever else is in the batch (slower; "
                                      "docs/batch_invariant.md). Default: on when $VLLM_BATCH_INVARIANT is set and "
                                      "not 0, as vLLM's switch")
    # The linear layers' quantization (worker_svc/quantization_config.py): None reads it from the
    # checkpoint (a compressed-tensors, AWQ or GPTQ quantization_config, a .gguf file); "fp8" quantizes an unquantized
    # checkpoint at load. `serve` takes it as a vLLM flag (pagedserve/vllm_flags.py refuses other values with
    # the reason) and forwards it (launcher.py `_worker_argv`).
    quantization: str | None = flag("--quantization", "-q", default=None, choices=QUANTIZATION_FLAG_VALUES,
                                     shared=False,
                                     help="fp8: quantize the weights to FP8 at load (W8A8, per-channel weights, "
                                          "per-token activations); compressed-tensors, awq, gptq, gguf: as the "
                                          "checkpoint says (given or not); docs/quantization.md")
    # Test only: the Nth forward pass raises (a worker fault on demand, across processes). None: never.
    fail_at_step: int | None = flag("--fail-at-step", default=None, hidden=True)
    # Fault injection: the process exits at once when a new request's tokens hold this id (poison requests).
    crash_on_token_id: int | None = flag("--crash-on-token-id", default=None, hidden=True)
    # With crash_on_token_id: exit instead when a row whose prompt holds that id is about to sample its N-th
    # output token (a poison request that crashes mid-decode, again at the same point after a recompute).
    crash_at_output_token: int | None = flag("--crash-at-output-token", default=None, hidden=True)
    # Test only: each step takes at least this many seconds per prompt token it computes (a slow CPU's
    # prefill, at a tiny model's cost: the abort-latency tests).
    prefill_seconds_per_token: float = flag("--prefill-seconds-per-token", default=0.0, hidden=True)
    # On the CPU: which cores each rank's torch threads are pinned to, and how many cores stay for the scheduler
    # and gateway (worker_svc/cpu_placement.py; vLLM's VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU).
    cpu_omp_threads_bind: str = flag("--cpu-omp-threads-bind", default="auto", parse=bind_value,
                                     env_default="VLLM_CPU_OMP_THREADS_BIND",
                                     help="CPU only: auto (the allowed cores less the reserved ones, split between "
                                          "the ranks, one pinned torch thread per core), nobind (no pinning, as "
                                          "many threads), or each rank's cores, e.g. 0-3|4-7. Default: "
                                          "$VLLM_CPU_OMP_THREADS_BIND, else auto")
    cpu_num_reserved_cpu: int | None = flag("--cpu-num-reserved-cpu", default=None,
                                            env_default="VLLM_CPU_NUM_OF_RESERVED_CPU",
                                            help="CPU only, with auto binding: cores no rank computes on (the "
                                                 "scheduler and gateway run there). Default: "
                                                 "$VLLM_CPU_NUM_OF_RESERVED_CPU, else 1 when there is a core to "
                                                 "spare beyond one per rank")
    # Tensor parallel: this process's rank of `world_size`, and where the ranks meet to form their
    # torch.distributed group (tcp://HOST:PORT that every rank reaches; rank 0 listens there). None: one rank.
    rank: int = flag("--rank", default=0, help="this worker's tensor-parallel rank", shared=False)
    world_size: int = flag("--world-size", default=1, help="tensor-parallel ranks in all", shared=False)
    distributed_init_method: str | None = flag(
        "--distributed-init-method", default=None, shared=False,
        help="tcp://HOST:PORT where the ranks form their torch.distributed group (rank 0 listens)")
    # Seconds between heartbeats to the scheduler; a scheduler silent for 3 of its own intervals is gone.
    heartbeat_interval: float = shared_flag_field(DEFAULT_HEARTBEAT_INTERVAL, HEARTBEAT_INTERVAL)

    def __post_init__(self) -> None:
        """The checks that span fields, as usage errors naming the flags."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SystemExit(f"--kv-cache-dtype {self.kv_cache_dtype}: supported: {', '.join(KV_CACHE_DTYPES)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise SystemExit("--num-kv-blocks must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise SystemExit("--gpu-memory-utilization must lie in (0, 1]")
        if self.swap_space < 0 or self.cpu_kv_cache_space <= 0:
            raise SystemExit("--swap-space must be >= 0 and --cpu-kv-cache-space > 0")
        if self.crash_at_output_token is not None and (self.crash_on_token_id is None
                                                       or self.crash_at_output_token < 1):
            raise SystemExit("--crash-at-output-token needs --crash-on-token-id and must be at least 1")
        if self.heartbeat_interval <= 0:
            raise SystemExit("--heartbeat-interval must be > 0")
        if self.cpu_num_reserved_cpu is not None and self.cpu_num_reserved_cpu < 0:
            raise SystemExit("--cpu-num-reserved-cpu must be >= 0")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise SystemExit(f"--rank {self.rank} is not a rank of --world-size {self.world_size} "
                             "(0 <= rank < world size)")
        if self.world_size > 1 and self.distributed_init_method is None:
            raise SystemExit("--world-size > 1 needs --distributed-init-method tcp://HOST:PORT (reachable by every "
                             "rank)")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


def add_worker_arguments(parser: argparse.ArgumentParser, *, shared_only: bool = True) -> None:
    """Worker flags: those `pagedserve serve` shares (the default), or all of them (`pagedserve worker`)."""
    add_config_arguments(parser, WorkerConfig, shared_only=shared_only)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The config of parsed worker flags; vLLM's dtype spellings become torch's."""
    values = flag_values(WorkerConfig, args)
    values["dtype"] = DTYPE_ALIASES.get(values["dtype"], values["dtype"])
    return WorkerConfig(**values)
