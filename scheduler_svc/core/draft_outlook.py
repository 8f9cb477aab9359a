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


class DraftOutlook:
    """Whether some running request would get drafts (`expected`), remembered per request for as long as its
    token count is unchanged: the engine asks on every turn of its loop, including those that only wait for a
    result, and the n-gram search copies and scans the request's tokens (thousands in a long chat)."""

    def __init__(self, speculative: SpeculativeConfig) -> None:
        self._speculative = speculative
        self._known: dict[str, tuple[int, bool]] = {}  # request id -> (its token count, would get drafts)

    def expected(self, running: Iterable[Request]) -> bool:
        """Whether some request of `running` would get drafts: one that samples plainly (the others never get
        any), and, with n-gram lookup, whose known tokens end with a suffix n-gram that occurred earlier."""
        running = list(running)
        if len(self._known) > 4 * len(running) + 16:  # finished requests' entries
            live = {request.request_id for request in running}
            self._known = {key: value for key, value in self._known.items() if key in live}
        return any(self._would_get_drafts(request) for request in running)

    def _would_get_drafts(self, request: Request) -> bool:
        if not samples_plainly(request):
            return False
        speculative = self._speculative
        if speculative.uses_draft_model:
            return True
        known = self._known.get(request.request_id)
        if known is not None and known[0] == request.num_tokens:
            return known[1]
        found = bool(propose_ngram_drafts(request.all_token_ids, speculative.prompt_lookup_min,
                                          speculative.prompt_lookup_max, 1))
        self._known[request.request_id] = (request.num_tokens, found)
        return found
