"""The worker process's loop: connect to the scheduler, load, then answer its messages until told to stop.

Why apart from worker.py: `Worker` executes steps (a pure function of the plans it got); this loop owns the
link (scheduler_link.py: a ZeroMQ DEALER connected to the scheduler's ROUTER, an IO thread that also exchanges
heartbeats), overlaps step N+1's launch with step N on the GPU, and turns failures into the exit codes and
WorkerErrors the scheduler and the launcher act on. Under tensor parallel only rank 0 answers steps (worker.py
says why).
"""

from __future__ import annotations

import gc
import logging
import os
import time

from protos.pagedserve.v1 import worker_pb2
from worker_svc.cancelled_requests import CancelledRequests
from worker_svc.config import WorkerConfig
from worker_svc.cpu_placement import place_worker
from service_runtime.worker_link_auth import link_keys_from
from worker_svc.scheduler_link import SchedulerLink, SchedulerLost
from worker_svc.launched_step import LaunchedStep
from worker_svc.worker import Worker

logger = logging.getLogger(__name__)

# How often the worker looks for the next plan while a step runs on the GPU.
_POLL_S = 0.0002


def run_worker(config: WorkerConfig) -> int:
    """Connects, loads, answers plans until told to shut down. Returns the process exit code: 0 when told
    to shut down, 1 when a step failed (the scheduler was told why) or the scheduler went silent."""
    if not config.device.startswith("cuda"):  # before the model loads: torch makes its threads at its first op
        place_worker(config.cpu_omp_threads_bind, config.cpu_num_reserved_cpu, config.rank, config.world_size)
    worker = Worker(config)
    # A single rank drops aborted requests' rows from the plans queued behind the step it runs (see
    # cancelled_requests.py for why tensor-parallel ranks do not).
    cancelled = CancelledRequests() if config.world_size == 1 else None
    link = SchedulerLink(config.scheduler_address, f"rank-{config.rank}".encode(), config.heartbeat_interval,
                         link_keys_from(os.environ), cancelled)
    hello = worker_pb2.WorkerHello(
        rank=config.rank,
        world_size=config.world_size,
        model_name=worker.model_name,
        vocab_size=worker.model_config.vocab_size,
        max_position_embeddings=worker.model_config.max_position_embeddings,
        batch_invariant=config.batch_invariant,
        quantization=worker.runner.quantization,
        kv_cache_dtype=worker.runner.kv_cache_dtype_name,
    )
    link.send(worker_pb2.WorkerToScheduler(hello=hello))
    answers_steps = config.rank == 0  # the other ranks' results would repeat rank 0's (module docstring)

    def answer(result: worker_pb2.StepResult) -> None:
        if answers_steps:
            link.send(worker_pb2.WorkerToScheduler(result=result))

    step_id = 0
    in_flight: LaunchedStep | None = None  # launched, result not sent yet
    waited = 0.0  # seconds spent waiting for the scheduler's next message (logged at shutdown)
    try:
        while True:
            started = time.perf_counter()
            message = link.receive() if in_flight is None else _next_plan_or_done(link, worker, in_flight)
            waited += time.perf_counter() - started
            if message is None:  # the step in flight is done and no plan is waiting
                answer(worker.finish(in_flight))
                in_flight = None
                continue
            kind = message.WhichOneof("kind")
            if kind == "plan" and cancelled is not None:
                cancelled.drop_rows(message.plan)
            if in_flight is not None and (kind != "plan" or not worker.can_overlap(message.plan)):
                answer(worker.finish(in_flight))
                in_flight = None
            if kind == "setup":
                link.send(worker_pb2.WorkerToScheduler(ready=worker.setup(message.setup)))
                gc.freeze()  # the model and pools live as long as the worker: out of the collector's full passes
            elif kind == "plan":
                # With the scheduler planning ahead, the next plan usually waits here while the GPU still
                # runs the previous step: launch it behind that step, then send the previous result.
                step_id = message.plan.step_id
                launched = worker.launch(message.plan, previous=in_flight)
                if in_flight is not None:
                    answer(worker.finish(in_flight))
                # A grammar row's draw needs the token it follows, known now: its masks fill on llguidance's
                # threads while the next plan is prepared; the next launch (or the wait below) draws.
                worker.begin_masks(launched)
                in_flight = launched
            elif kind == "shutdown":
                logger.info("rank %d: shutdown requested; %s; waited %.2f s for plans; %s; %s%s", config.rank,
                            worker.step_timer.summary(), waited, worker.gpu_clock.summary(),
                            worker.runner.device_busy.summary(), worker.grammar_summary())
                return 0
    except SchedulerLost as lost:
        logger.error("rank %d: %s; exiting", config.rank, lost)
        return 1
    except Exception as error:
        logger.exception("rank %d failed at step %d", config.rank, step_id)
        failure = worker_pb2.WorkerError(rank=config.rank, step_id=step_id, message=f"{type(error).__name__}: {error}")
        link.send(worker_pb2.WorkerToScheduler(error=failure))
        return 1
    finally:
        link.close()


def _next_plan_or_done(link: SchedulerLink, worker: Worker,
                       step: LaunchedStep) -> worker_pb2.SchedulerToWorker | None:
    """The next scheduler message, or None once `step`'s results are on the host with none waiting. A step
    whose deferred draw waits for the next launch is drawn here when no plan is waiting."""
    while True:
        message = link.poll(_POLL_S)
        if message is not None:
            return message
        if step.draw_pending:
            worker.complete(step)
        elif step.ready():
            return None
