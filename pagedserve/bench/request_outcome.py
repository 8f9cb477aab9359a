"""What one benchmark request sent and what the client saw of it: the timing record every backend fills.

Why every time is the client's (time.perf_counter on this machine): a benchmark measures what a user
waits for. `ttft`: from just before the request is sent to the arrival of the first chunk that carries
output. `itl`: the gaps between successive such chunks (a chunk carrying several tokens is one gap).
`latency` (end-to-end): from the send to the arrival of the response's last chunk. A request whose HTTP
status is not 200, which raised, or whose stream ended before its end marker is failed (`success` False,
`error` says why) and is left out of every latency figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestInput:
    """One request as a backend sends it: `prompt` text or token ids, `output_len` its max_tokens."""

    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    ignore_eos: bool
    sampling: dict[str, float | int]  # temperature, top_p, top_k as given on the command line


@dataclass
class RequestOutcome:
    """Filled by a backend as the response streams in (so: not frozen); read by serve_metrics."""

    prompt_len: int
    start_time: float = 0.0
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    output_tokens: int | None = None  # as the server's usage reports; None: it did not say
    num_output_chunks: int = 0
    error: str = ""

    def saw_output(self, now: float, last_output_time: float | None) -> float:
        """Records a chunk carrying output that arrived at `now`; returns `now` (the next gap's start)."""
        if last_output_time is None:
            self.ttft = now - self.start_time
        else:
            self.itl.append(now - last_output_time)
        self.num_output_chunks += 1
        return now

    def fail(self, error: str) -> RequestOutcome:
        self.success = False
        self.error = error
        return self
