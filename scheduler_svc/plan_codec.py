"""Translation between the scheduler's typed step output and the worker wire schema (protos/.../worker.proto).

The only place that knows both shapes: the scheduler core stays free of protobuf, the worker free of the
scheduler's classes.
"""

from __future__ import annotations

from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import SchedulerOutput


def encode_step_plan(output: SchedulerOutput) -> worker_pb2.SchedulerToWorker:
    plan = worker_pb2.StepPlan(
        step_id=output.step_id,
        finished_request_ids=list(output.finished_request_ids),
        preempted_request_ids=list(output.preempted_request_ids),
        swap_out=[worker_pb2.BlockMove(src=src, dst=dst) for src, dst in output.swap_out],
        swap_in=[worker_pb2.BlockMove(src=src, dst=dst) for src, dst in output.swap_in],
        copy=[worker_pb2.BlockMove(src=src, dst=dst) for src, dst in output.copy],
    )
    for new in output.new_requests:
        plan.new_requests.append(
            worker_pb2.NewRequest(
                request_id=new.request_id,
                token_ids=new.token_ids,
                sampling=_worker_sampling(new.sampling_params),
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=new.num_scheduled_tokens,
            )
        )
    for cached in output.scheduled_requests:
        plan.scheduled_requests.append(
            worker_pb2.ScheduledRequest(
                request_id=cached.request_id,
                new_block_ids=cached.new_block_ids,
                num_scheduled_tokens=cached.num_scheduled_tokens,
            )
        )
    return worker_pb2.SchedulerToWorker(plan=plan)


def _worker_sampling(params: SamplingParams) -> worker_pb2.WorkerSamplingParams:
    assert params.seed is not None, "the engine seeds every request at admission"
    return worker_pb2.WorkerSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )


def decode_sampled_tokens(result: worker_pb2.StepResult) -> dict[str, int]:
    return {sampled.request_id: sampled.token_id for sampled in result.sampled}
