"""Launch-time numeric choices shared by the Triton kernels: interpreter upcast and fp32 dot precision.

Why these are host-side decisions passed in as constexprs, not module globals: Triton reads
TRITON_INTERPRET when a kernel is decorated, but the numerics a launch needs depend on the tensors of
that launch. Two facts drive them:

- Under TRITON_INTERPRET=1 (the CPU test path) bf16/fp16 arithmetic inside a kernel, `tl.dot` included,
  returns wrong numbers without raising; loads, stores and casts are fine. Kernels therefore take an
  `UPCAST` constexpr that converts 16-bit operands to fp32 right after loading; on a GPU it is False and
  the tensor cores see bf16.
- fp32 `tl.dot` runs as TF32 on the GPU unless told otherwise; an fp32 model (the token-exact check
  against Hugging Face) needs IEEE fp32 products, so fp32 inputs get `input_precision="ieee"`.
"""

from __future__ import annotations

import torch
import triton


def is_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), read at launch."""
    return bool(triton.knobs.runtime.interpret)


def has_libdevice() -> bool:
    """Whether kernels may call libdevice's math functions (the interpreter has none)."""
    return not is_interpreting()


def needs_upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel on `dtype` data must do its arithmetic in fp32 to be right in this process."""
    return is_interpreting() and dtype in (torch.bfloat16, torch.float16)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands of `dtype`: exact fp32 products for fp32 data."""
    return "ieee" if dtype == torch.float32 else "tf32"
