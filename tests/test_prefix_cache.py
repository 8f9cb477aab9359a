"""Prefix caching: full blocks keyed by a hash chain, reused by later requests with the same prefix (also within
one step), kept after release in LRU order until the pool hands them out again, and counted for the stats RPC.
Driven through the real Scheduler and the fake worker, which checks every reused block's content. Pure Python."""

from __future__ import annotations

from scheduler_svc.core.block_hash import chain_block_key
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from tests.test_scheduler import EOS, make_scheduler, step

SYSTEM_PROMPT = list(range(500, 522))  # 22 tokens: 5 full blocks of 4, then 2 tokens


def request_with_prompt(request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=3), (EOS,))


def run_to_completion(scheduler, worker) -> None:
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)


def test_key_chain_depends_on_the_whole_prefix():
    first, other_first = chain_block_key(None, [1, 2]), chain_block_key(None, [3, 4])
    assert chain_block_key(first, [5, 6]) == chain_block_key(chain_block_key(None, [1, 2]), [5, 6])
    assert chain_block_key(first, [5, 6]) != chain_block_key(other_first, [5, 6])
    assert chain_block_key(None, [5, 6]) != chain_block_key(first, [5, 6])
    assert chain_block_key(None, [1, 2]) != chain_block_key(None, [2, 1])


def test_a_request_sharing_a_prefix_starts_after_the_shared_full_blocks():
    scheduler, worker = make_scheduler()
    scheduler.add_request(request_with_prompt("first", SYSTEM_PROMPT + [1, 2, 3]))
    run_to_completion(scheduler, worker)

    scheduler.add_request(request_with_prompt("second", SYSTEM_PROMPT + [7, 8, 9, 10, 11]))
    output, _ = step(scheduler, worker)  # the worker checks the reused blocks hold the system prompt
    (new,) = output.new_requests
    assert new.num_computed_tokens == 20 and new.num_scheduled_tokens == 27 - 20  # 5 full shared blocks
    assert scheduler.get_request("second").num_computed_tokens == 27
    run_to_completion(scheduler, worker)
    assert scheduler.get_request("second") is None


def test_a_prompt_found_whole_in_the_cache_still_computes_its_last_block():
    scheduler, worker = make_scheduler()
    prompt = SYSTEM_PROMPT[:20]  # exactly 5 blocks
    scheduler.add_request(request_with_prompt("first", prompt))
    run_to_completion(scheduler, worker)
    scheduler.add_request(request_with_prompt("again", prompt))
    output, updated = step(scheduler, worker)
    (new,) = output.new_requests
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (16, 4)
    assert [r.request_id for r in updated] == ["again"]  # it sampled


def test_a_request_admitted_later_in_the_same_step_reuses_blocks_computed_in_that_step():
    scheduler, worker = make_scheduler()
    scheduler.add_request(request_with_prompt("a", SYSTEM_PROMPT))
    scheduler.add_request(request_with_prompt("b", SYSTEM_PROMPT + [1]))
    output, _ = step(scheduler, worker)  # the fake worker writes every token before anything reads
    a, b = output.new_requests
    assert (a.num_computed_tokens, b.num_computed_tokens) == (0, 20)
    assert b.block_ids[:5] == a.block_ids[:5]


def test_caching_off_means_no_hits_and_no_counts():
    scheduler, worker = make_scheduler(enable_prefix_caching=False)
    for request_id in ("first", "second"):
        scheduler.add_request(request_with_prompt(request_id, SYSTEM_PROMPT))
        output, _ = step(scheduler, worker)
        assert output.new_requests[0].num_computed_tokens == 0
        run_to_completion(scheduler, worker)
    assert scheduler.prefix_cache_query_tokens == 0 and scheduler.prefix_cache_hit_rate == 0.0


def test_hit_rate_counts_queried_and_hit_tokens_over_every_admission():
    scheduler, worker = make_scheduler()
    scheduler.add_request(request_with_prompt("first", SYSTEM_PROMPT))  # 22 queried, 0 hit
    run_to_completion(scheduler, worker)
    scheduler.add_request(request_with_prompt("second", SYSTEM_PROMPT + [1, 2]))  # 24 queried, 20 hit
    run_to_completion(scheduler, worker)
    assert (scheduler.prefix_cache_query_tokens, scheduler.prefix_cache_hit_tokens) == (46, 20)
    assert scheduler.prefix_cache_hit_rate == 20 / 46


def test_the_hit_counts_survive_the_cache_being_emptied():
    """The counters are the cache's: an empty cache (every cached block evicted by later allocations) still reports
    them. (They once read 0 then: `if cache` took an empty PrefixCache, which has a length, for no cache.)"""
    manager = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0)
    for request_id in ("first", "second"):
        request = request_with_prompt(request_id, [1, 2, 3, 4, 5, 6, 7, 8, 9])
        prefix = manager.find_cached_prefix(request, 8)
        manager.allocate_slots(request, 9 - prefix.num_tokens, cached_prefix=prefix)
        manager.free(request_id)
    assert (manager.prefix_cache_query_tokens, manager.prefix_cache_hit_tokens) == (18, 8)
    for request_id in ("a", "b", "c"):  # every block written with other tokens: the cache is empty
        manager.allocate_slots(request_with_prompt(request_id, [20 + len(request_id)] * 3), 3)
    assert not manager.cached_blocks()
    assert (manager.prefix_cache_query_tokens, manager.prefix_cache_hit_tokens) == (18, 8)
    assert manager.prefix_cache_hit_rate == 8 / 18


def test_released_blocks_stay_cached_count_as_free_and_are_evicted_least_recently_used_tail_first():
    manager = BlockManager(block_size=4, num_gpu_blocks=6, num_cpu_blocks=0)
    old = request_with_prompt("old", [1, 2, 3, 4, 5, 6, 7, 8])
    new = request_with_prompt("new", [9, 10, 11, 12, 13, 14, 15, 16])
    for request in (old, new):
        manager.allocate_slots(request, 8)
    old_table, new_table = manager.block_table("old"), manager.block_table("new")
    manager.free("old")
    manager.free("new")
    assert manager.num_free_gpu_blocks == 6 and len(manager.cached_blocks()) == 4
    # The two never-used blocks first, then old's blocks (tail first), then new's.
    order = manager.free_gpu_block_ids()
    assert order[2:] == [old_table[1], old_table[0], new_table[1], new_table[0]]

    grabber = request_with_prompt("grabber", list(range(100, 112)))
    grabbed = manager.allocate_slots(grabber, 12).new_block_ids  # both unused blocks, then old's tail
    assert grabbed == tuple(order[:3])
    assert set(manager.cached_blocks().values()) == {old_table[0], *new_table, *grabbed}  # old's tail evicted
    old_again = request_with_prompt("old-again", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert manager.find_cached_prefix(old_again, 8).block_ids == (old_table[0],)  # its second block is gone
    manager.check_invariants()


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_list():
    manager = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    first = request_with_prompt("first", [1, 2, 3, 4, 5])
    manager.allocate_slots(first, 5)
    cached_block = manager.block_table("first")[0]
    manager.free("first")
    second = request_with_prompt("second", [1, 2, 3, 4, 6, 7])
    prefix = manager.find_cached_prefix(second, second.num_tokens - 1)
    assert prefix.block_ids == (cached_block,)
    allocation = manager.allocate_slots(second, 2, cached_prefix=prefix)
    assert manager.block_table("second") == [cached_block, *allocation.new_block_ids]
    assert manager.gpu_ref_count(cached_block) == 1 and manager.num_free_gpu_blocks == 2
    manager.check_invariants()


def test_recompute_after_preemption_reuses_the_requests_own_cached_blocks():
    scheduler, worker = make_scheduler(block_size=4, num_gpu_blocks=8, max_num_batched_tokens=64)
    scheduler.add_request(request_with_prompt("a", list(range(100, 113)), max_tokens=8))  # 4 blocks at most
    scheduler.add_request(request_with_prompt("b", list(range(200, 213)), max_tokens=8))
    preempted = None
    while scheduler.has_unfinished_requests() and preempted is None:
        output, _ = step(scheduler, worker)
        preempted = output.preempted_request_ids[0] if output.preempted_request_ids else None
    assert preempted == "b"
    output, _ = step(scheduler, worker)
    while not output.new_requests:
        output, _ = step(scheduler, worker)
    (resumed,) = output.new_requests
    assert resumed.request_id == "b" and resumed.num_computed_tokens > 0
