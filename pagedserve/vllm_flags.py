"""vLLM `serve` flags that pagedserve refuses, each with the reason, so that a command line copied from vLLM
fails on the first one we cannot honour instead of running with it silently ignored.

Why a table and not argparse's "unrecognized arguments": these are flags a vLLM user is likely to bring
along, and the refusal says why and what to do instead. A flag of vLLM's that is in neither this table nor
the parser still fails, with argparse's message. Some flags are refused only for values other than the one
pagedserve has (`--pipeline-parallel-size 1`, `--cpu-offload-gb 0` are fine). `--kv-cache-dtype` is a worker flag
(worker_svc/config.py): auto, fp8 and fp8_e4m3 are served, and its parser refuses vLLM's other values naming
these.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from worker_svc.quantization_config import QUANTIZATION_FLAG_VALUES


@dataclass(frozen=True)
class RefusedFlag:
    """One vLLM flag. `takes_value`: whether it is `--flag VALUE` (else a switch); `accepted`: the values
    that mean what pagedserve does anyway (empty: every use is refused)."""

    names: tuple[str, ...]
    reason: str
    takes_value: bool = True
    accepted: tuple[str, ...] = ()


NOT_YET = "pagedserve does not support it (yet)"

REFUSED_FLAGS = (
    RefusedFlag(("--pipeline-parallel-size", "-pp"), "pagedserve has no pipeline parallelism; use "
                "--tensor-parallel-size", accepted=("1",)),
    RefusedFlag(("--enable-expert-parallel",), "pagedserve has no expert parallelism", takes_value=False),
    RefusedFlag(("--cpu-offload-gb",), f"weight offloading to the CPU: {NOT_YET}", accepted=("0",)),
    RefusedFlag(("--quantization", "-q"), "supported: gguf (a .gguf model file; its quantization is read from "
                "the file), compressed-tensors (FP8 W8A8, INT8 W8A8 and W4A16/W8A16 checkpoints, read from their "
                "config.json), awq and gptq (their checkpoints, read alike; vLLM's awq_marlin and gptq_marlin name the same "
                "checkpoints) and fp8 (online FP8 of an unquantized checkpoint; docs/quantization.md); other "
                "methods: " + NOT_YET,
                accepted=QUANTIZATION_FLAG_VALUES),
    RefusedFlag(("--trust-remote-code",), "pagedserve never runs a model repository's Python code; it serves "
                "the architectures it implements itself (docs/serving.md: Supported architectures), so the flag "
                "is not needed",
                takes_value=False),
    RefusedFlag(("--tokenizer-mode",), "pagedserve has one tokenizer implementation (the model's tokenizer.json, "
                "vocab/merges or GGUF vocabulary)", accepted=("auto", "hf")),
    RefusedFlag(("--revision",), f"hub revisions: {NOT_YET}; download the revision and pass its directory"),
    RefusedFlag(("--tokenizer-revision",), f"hub revisions: {NOT_YET}; download it and pass --tokenizer DIR"),
    RefusedFlag(("--download-dir",), f"{NOT_YET}; set HF_HUB_CACHE to choose where hub models are stored"),
    RefusedFlag(("--guided-decoding-backend",), "structured outputs always run on llguidance "
                "(docs/structured_outputs.md)", accepted=("auto", "guidance", "llguidance")),
    RefusedFlag(("--limit-mm-per-prompt", "--mm-processor-kwargs"), "pagedserve serves text-only models"),
    RefusedFlag(("--rope-scaling", "--rope-theta", "--hf-overrides"), f"overriding the model's config: {NOT_YET}; "
                "edit its config.json"),
    RefusedFlag(("--enable-sleep-mode",), f"sleep mode: {NOT_YET}", takes_value=False),
    RefusedFlag(("--kv-transfer-config", "--kv-events-config"), f"disaggregated serving: {NOT_YET}"),
    RefusedFlag(("--max-seq-len-to-capture",), "pagedserve captures CUDA graphs for decode steps of any length"),
    RefusedFlag(("--ssl-keyfile", "--ssl-certfile"), "the HTTP server has no TLS of its own: put a TLS proxy in "
                "front (gRPC has --tls-cert-file/--tls-key-file)"),
    RefusedFlag(("--task", "--runner"), "pagedserve serves text generation only", accepted=("auto", "generate")),
)


class _RefuseAction(argparse.Action):
    """Exits with a usage error naming the flag and the reason, unless the value is an accepted one."""

    def __init__(self, option_strings, dest, refused: RefusedFlag, **kwargs):
        super().__init__(option_strings, dest, nargs=None if refused.takes_value else 0, default=None,
                         help=argparse.SUPPRESS, **kwargs)
        self.refused = refused

    def __call__(self, parser, namespace, values, option_string=None):
        if self.refused.takes_value and str(values) in self.refused.accepted:
            setattr(namespace, self.dest, values)
            return
        shown = option_string if not self.refused.takes_value else f"{option_string} {values}"
        parser.error(f"{shown}: not supported: {self.refused.reason}")


def add_refused_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every flag of REFUSED_FLAGS to `parser` (hidden from --help: docs/switching_from_vllm.md's table
    lists them)."""
    for refused in REFUSED_FLAGS:
        dest = refused.names[0].lstrip("-").replace("-", "_")
        parser.add_argument(*refused.names, dest=dest, action=_RefuseAction, refused=refused)
