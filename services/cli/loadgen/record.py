"""What one request did, as the load generator saw it from the client side."""

from __future__ import annotations

from dataclasses import dataclass

OK = "OK"


@dataclass(frozen=True)
class RequestRecord:
    """One sent request: its gRPC status and, when it streamed tokens, its timings.

    Times are seconds on the client's monotonic clock: `offset_s` since the run began, `send_lag_s`
    how late the send was against its planned arrival (a busy client shows up here, not as server
    latency), `ttft_s` until the first token arrived, `e2e_s` until the stream ended.
    """

    intent: str
    status: str
    offset_s: float
    e2e_s: float
    ttft_s: float | None = None
    send_lag_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        """Whether the RPC ended with status OK."""
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)
