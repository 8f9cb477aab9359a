"""Head of line: a long request waiting for blocks while short ones hold them, under a steady stream of new
short requests. Neither side waits forever: the long one starts as soon as the requests ahead of it drain
(the shorts behind it do not overtake it, so it cannot starve), and every short one behind it starts once
the long one is running. Pure Python, on the fake worker."""

from __future__ import annotations

from scheduler_svc.core.request import RequestStatus
from tests.test_scheduler import make_request, make_scheduler, step

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 16  # 64 tokens
SHORT = dict(prompt_len=4, max_tokens=8, ignore_eos=True)  # 12 tokens: 3 blocks
LONG = dict(prompt_len=8, max_tokens=48, ignore_eos=True)  # 56 tokens: 14 of the 16 blocks


def test_a_long_request_is_not_starved_by_short_ones_and_does_not_block_them_forever():
    scheduler, worker = make_scheduler(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=8)
    requests = {}
    for index in range(4):
        requests[f"early{index}"] = make_request(f"early{index}", **SHORT)
        scheduler.add_request(requests[f"early{index}"])
    step(scheduler, worker)
    requests["long"] = make_request("long", **LONG)
    scheduler.add_request(requests["long"])
    arrived: dict[str, int] = {"long": 1}
    started: dict[str, int] = {}
    for step_index in range(1, 400):
        if step_index < 150:  # a new short request every step, all arriving after the long one
            request_id = f"late{step_index}"
            requests[request_id] = make_request(request_id, **SHORT)
            scheduler.add_request(requests[request_id])
            arrived[request_id] = step_index
        output, _ = step(scheduler, worker)
        for new in output.new_requests:
            started.setdefault(new.request_id, step_index)
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "some request never finished"
    assert all(request.status is RequestStatus.FINISHED_LENGTH for request in requests.values())
    assert started["long"] - arrived["long"] <= SHORT["max_tokens"] + 1, "the long one starts once those ahead drain"
    late_starts = {rid: started[rid] for rid in arrived if rid.startswith("late")}
    assert min(late_starts.values()) >= started["long"], "no short request overtakes the long one"
    longest_wait = max(started[rid] - arrived[rid] for rid in late_starts)
    assert longest_wait <= SHORT["max_tokens"] + LONG["max_tokens"] + 2 * SHORT["max_tokens"], longest_wait
    assert scheduler.block_manager.num_free_gpu_blocks == NUM_GPU_BLOCKS
