"""Async Generate calls against a gateway, timed on the client side."""

from __future__ import annotations

import time

import grpc

from services.cli.client import build_request, call_metadata, finish_name
from services.cli.loadgen.record import OK, RequestRecord
from services.cli.loadgen.workload import PlannedRequest
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


class GatewayLoadClient:
    """One aio channel to the gateway, shared by every in-flight request of a run."""

    def __init__(self, target: str, token: str, *, model: str = "", timeout_s: float = 300.0) -> None:
        self.target = target
        self.token = token
        self.model = model
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.GatewayServiceStub(self._channel)

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close(grace=None)

    async def send(self, planned: PlannedRequest, run_start_s: float) -> RequestRecord:
        """Streams one request to its end and records what happened; never raises for an RPC error."""
        request = build_request(
            planned.prompt, chat=planned.chat, model=self.model, max_tokens=planned.max_tokens
        )
        started_s = time.monotonic()
        offset_s = started_s - run_start_s
        lag_s = max(0.0, offset_s - planned.offset_s) if planned.offset_s is not None else 0.0
        first_token_s: float | None = None
        done: pb.Completion | None = None
        num_streamed_tokens = 0
        call = self._stub.Generate(
            request, metadata=call_metadata(self.token, planned.intent), timeout=self.timeout_s
        )
        try:
            async for response in call:
                if response.HasField("delta"):
                    num_streamed_tokens += len(response.delta.token_ids)
                    if first_token_s is None and response.delta.token_ids:
                        first_token_s = time.monotonic()
                else:
                    done = response.done
        except grpc.aio.AioRpcError as error:
            return RequestRecord(
                planned.intent,
                error.code().name,
                offset_s,
                time.monotonic() - started_s,
                send_lag_s=lag_s,
                error=error.details(),
            )
        return self._record(
            planned.intent, started_s, offset_s, lag_s, first_token_s, done, num_streamed_tokens
        )

    @staticmethod
    def _record(
        intent: str,
        started_s: float,
        offset_s: float,
        lag_s: float,
        first_token_s: float | None,
        done: pb.Completion | None,
        num_streamed_tokens: int,
    ) -> RequestRecord:
        ended_s = time.monotonic()
        return RequestRecord(
            intent,
            OK,
            offset_s,
            ended_s - started_s,
            ttft_s=None if first_token_s is None else first_token_s - started_s,
            send_lag_s=lag_s,
            num_prompt_tokens=done.usage.prompt_tokens if done else 0,
            num_output_tokens=done.usage.completion_tokens if done else num_streamed_tokens,
            finish_reason=finish_name(done.finish_reason) if done else None,
        )
