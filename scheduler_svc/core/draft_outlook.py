"""Whether the next plan is likely to carry draft tokens: what decides if a small speculating batch waits for
each result before planning (Scheduler.max_steps_ahead).

Why it matters: drafts are proposed only from a request's newest token, so a step with drafts cannot be
planned while the step before it runs; the engine then plans, waits, applies, plans, and the host's share of
each step (the scheduler's planning, the plan's trip, the worker's launch: about 2 ms a step on an H200) is no
longer hidden behind the GPU. Measured on the Llama-3.1-8B shape: 1.42x the TPOT of speculation off for a
request whose output never repeats its context, where the n-gram proposer finds nothing and no step carries a
draft. So the engine waits for results only while some running request's known tokens give the n-gram
proposer a proposal, and otherwise plans ahead as without speculation; once a proposal appears (judged on the
tokens known, the newest pending one aside), it stops planning ahead and the step after the one in flight gets
its drafts. A draft model proposes after every step: it waits while some running request can take drafts.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.ngram_proposer import propose_ngram_drafts
from scheduler_svc.core.request import Request
from scheduler_svc.core.speculative_config import SpeculativeConfig
from scheduler_svc.core.step_planner import samples_plainly


def drafts_expected(running: Iterable[Request], speculative: SpeculativeConfig) -> bool:
    """Whether some request of `running` would get drafts: one that samples plainly (the others never get
    any), and, with n-gram lookup, whose known tokens end with a suffix n-gram that occurred earlier in them."""
    if speculative.uses_draft_model:
        return any(samples_plainly(request) for request in running)
    return any(samples_plainly(request) and propose_ngram_drafts(
        request.all_token_ids, speculative.prompt_lookup_min, speculative.prompt_lookup_max, 1)
        for request in running)
