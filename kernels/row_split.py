"""How many programs share one row of a streaming pass over [N, V] values.

Why: with one program per row, a few hundred rows give a GPU's SMs about two programs each. The gather
(kernels/triton_gather.py) runs best in small programs (1024-entry blocks, 4 warps: its atomic slots take
registers), and two of those per SM leave the memory underfed (three programs per row run the pass about twice
as fast; docs/benchmarks.md, "Kernel tuning"). Splitting each row into
interleaved block ranges gives every SM several programs to switch between. The passes whose per-row results
combine by atomics or by position (the gather, the group maxes of kernels/triton_kth_largest.py) take the
split; passes that need a row's blocks in order keep one program per row.
"""

from __future__ import annotations

import torch

# Programs in flight per SM that hid the loads' latency in these passes.
_PROGRAMS_PER_SM = 4


def programs_per_row(num_rows: int, num_blocks: int, device: torch.device) -> int:
    """At least one, at most the row's block count; enough for _PROGRAMS_PER_SM programs on each SM (on the
    CPU, where the interpreter runs programs one by one, one)."""
    if device.type != "cuda" or num_rows == 0:
        return 1
    streaming_multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-_PROGRAMS_PER_SM * streaming_multiprocessors // num_rows)
    return max(1, min(num_blocks, wanted))
