"""Poison-request blame after worker losses (scheduler_svc/worker_loss_suspects.py and the scheduler's side of
it), without processes: a request that crashes its worker at admission is failed at its second loss, one that
crashes it mid-decode among others (every recompute replays it up to the same point) at its third, and requests
that merely lived through unrelated losses or another request's poison are never failed."""

from __future__ import annotations

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.lost_work import LostWork
from scheduler_svc.worker_loss_suspects import WorkerLossSuspects
from tests.fake_worker import FakeWorker
from tests.test_scheduler import make_request, make_scheduler, step

MAX_LOSSES = 2


def _decoding(outputs: dict[str, int], samples: int = 3) -> list[LostWork]:
    """Requests decoding together when the worker died: each was to sample `samples` tokens in the lost steps."""
    return [LostWork(request_id, n, samples, joined=False) for request_id, n in outputs.items()]


def _recomputed(outputs: dict[str, int], samples: int = 1) -> list[LostWork]:
    """Requests whose recompute (a NewRequestData) was in the lost steps."""
    return [LostWork(request_id, n, samples, joined=True) for request_id, n in outputs.items()]


def _clear_released(suspects: WorkerLossSuspects, outputs: dict[str, int], tokens: int = 3) -> list[str]:
    """Every suspect released now runs `tokens` tokens further on the new worker; returns them."""
    held = suspects.held()
    released = [request_id for request_id in outputs if request_id not in held and suspects.losses(request_id)]
    for request_id in released:
        outputs[request_id] += tokens
        suspects.on_token(request_id, outputs[request_id])
    return released


def test_a_request_crashing_at_admission_is_recomputed_after_the_others_and_failed_at_its_second_loss():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    outputs = {"a": 30, "b": 31, "c": 29}
    assert suspects.on_worker_loss([*_decoding(outputs), *_recomputed({"poison": 0})]) == {}
    assert suspects.held() == {"poison"}  # the others first
    assert _clear_released(suspects, outputs) == ["a", "b", "c"]
    assert suspects.held() == set()  # now the poison, alone among suspects
    failed = suspects.on_worker_loss([*_decoding(outputs), *_recomputed({"poison": 0})])
    assert failed == {"poison": 2}
    assert suspects.held() == set()  # a, b, c: one loss each, recomputed together
    assert _clear_released(suspects, outputs) == ["a", "b", "c"] and not suspects


def test_a_request_crashing_mid_decode_among_others_is_singled_out_and_failed_at_its_third_loss():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    # The poison dies sampling its 20th token; async scheduling had brought back only 18 of them.
    outputs = {"a": 40, "b": 41, "poison": 18, "c": 39}
    assert suspects.on_worker_loss(_decoding(outputs)) == {}
    assert suspects.held() == set()  # one wave: everyone decoding together
    # Recomputed together (a token each), then one more decode: the poison dies sampling its 20th again.
    for request_id in outputs:
        outputs[request_id] += 1
        assert not suspects.on_token(request_id, outputs[request_id])  # not past where the worker died
    assert suspects.on_worker_loss(_decoding(outputs, samples=2)) == {}  # the same evidence against all four
    assert suspects.held() == {"b", "poison", "c"}  # one at a time, in the order first suspected
    assert _clear_released(suspects, outputs) == ["a"]
    assert _clear_released(suspects, outputs) == ["b"]
    assert suspects.held() == {"c"}
    failed = suspects.on_worker_loss([*_decoding({"a": outputs["a"], "b": outputs["b"]}),
                                      *_recomputed({"poison": outputs["poison"]})])
    assert failed == {"poison": 3}
    assert suspects.held() == {"c"}  # a and b (one loss each) go first, c (two) alone after
    assert _clear_released(suspects, outputs) == ["a", "b"]
    assert _clear_released(suspects, outputs) == ["c"] and not suspects


def test_while_restarts_are_left_a_request_first_lost_alone_after_a_tie_is_tried_alone_once_more():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    outputs = {"a": 10, "b": 12}
    suspects.on_worker_loss(_decoding(outputs), restarts_left=999)
    assert suspects.on_worker_loss(_recomputed(outputs), restarts_left=998) == {}  # a tie
    assert suspects.held() == {"b"}
    # A random kill while `a` is recomputed alone: not failed, and alone again first.
    assert suspects.on_worker_loss(_recomputed({"a": 10}), restarts_left=997) == {}
    assert suspects.held() == {"b"} and suspects.losses("a") == 3
    assert suspects.on_worker_loss(_recomputed({"a": 10}), restarts_left=996) == {"a": 4}
    assert _clear_released(suspects, outputs) == ["b"] and not suspects


def test_a_request_joining_while_another_crashes_mid_decode_is_not_failed():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    outputs = {"a": 40, "poison": 19, "new": 0}
    assert suspects.on_worker_loss([*_decoding({"a": 40, "poison": 19}), *_recomputed({"new": 0})]) == {}
    assert suspects.held() == {"new"}
    # The poison's recompute samples its 20th token: the worker dies in the first step after the restart.
    assert suspects.on_worker_loss(_recomputed({"a": 40, "poison": 19})) == {}
    assert "new" not in suspects.held()  # one loss: before the two that share two
    assert _clear_released(suspects, outputs) == ["new"]
    assert _clear_released(suspects, outputs) == ["a"]
    assert suspects.on_worker_loss([*_decoding({"new": outputs["new"], "a": outputs["a"]}),
                                    *_recomputed({"poison": 19})]) == {"poison": 3}


def test_requests_that_ran_past_their_crash_point_between_unrelated_losses_are_never_failed():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    outputs = {"a": 5, "b": 9}
    for _ in range(10):  # a random kill, then each runs past where it was
        assert suspects.on_worker_loss(_decoding(outputs)) == {}
        for request_id in outputs:
            outputs[request_id] += 3
            suspects.on_token(request_id, outputs[request_id])
        assert not suspects


def test_a_lone_request_lost_twice_before_its_crash_point_is_failed_and_an_ended_one_is_forgotten():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    assert suspects.on_worker_loss(_decoding({"a": 5, "b": 6})) == {}
    assert suspects.drop_gone(lambda request_id: request_id == "b") and suspects.losses("b") == 0
    assert suspects.on_worker_loss(_recomputed({"a": 5})) == {"a": 2}
    assert suspects.on_worker_loss([]) == {} and not suspects


def test_the_members_of_one_client_request_wait_and_go_together():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    # A beam search's rows: one was forked in the lost steps (joined), its siblings were running.
    suspects.on_worker_loss([*_decoding({"other": 7}), *_decoding({"beam-0": 3, "beam-1": 3}),
                             *_recomputed({"beam-2": 3})])
    group_of = {"other": "other", "beam-0": "beam", "beam-1": "beam", "beam-2": "beam"}.get
    assert suspects.held(group_of) == set()  # all in the first wave, with the earliest of its rows
    suspects.on_worker_loss(_decoding({"other": 7, "beam-0": 3, "beam-1": 3, "beam-2": 3}))
    assert suspects.held(group_of) == {"beam-0", "beam-1", "beam-2"}  # one client request at a time
    suspects.on_token("other", 10)
    assert suspects.held(group_of) == set()


def test_a_released_client_request_stays_released_and_the_next_wave_waits_for_all_of_it():
    suspects = WorkerLossSuspects(MAX_LOSSES)
    group_of = {"s": "s", "g-0": "g", "g-1": "g"}.get
    suspects.on_worker_loss(_decoding({"s": 4, "g-0": 4, "g-1": 4}))
    suspects.held(group_of)
    suspects.on_worker_loss(_recomputed({"s": 4, "g-1": 4}))  # g-0 was held back by nothing: not in the steps
    assert suspects.held(group_of) == {"s"}  # g goes with g-0 (one loss), before s (two)
    assert suspects.on_token("g-0", 7)
    assert suspects.held(group_of) == {"s"}  # g-1 (two losses, first suspected after s) stays released
    assert suspects.on_token("g-1", 7)
    assert suspects.held(group_of) == set()


def test_the_scheduler_reports_each_lost_requests_samples_and_keeps_held_requests_out_of_steps():
    scheduler, worker = make_scheduler(max_steps_in_flight=2, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_len=4))
    step(scheduler, worker)  # a: prompt computed, 1 token back
    scheduler.add_request(make_request("long", prompt_len=12))
    scheduler.schedule()  # a decodes, long's first chunk (7 tokens)
    scheduler.schedule()  # a decodes, long's second chunk (5 tokens) samples
    lost = {work.request_id: work for work in scheduler.recover_from_worker_loss(BlockManager(4, 64, 0))}
    assert lost["a"] == LostWork("a", 1, 2, joined=False)
    assert lost["long"] == LostWork("long", 0, 1, joined=True)

    scheduler.hold({"long"})
    worker = FakeWorker(4, 64, 0)
    output, _ = step(scheduler, worker)
    assert [data.request_id for data in output.new_requests] == ["a"]
    scheduler.hold(set())
    output, _ = step(scheduler, worker)
    assert "long" in output.num_scheduled_tokens()
