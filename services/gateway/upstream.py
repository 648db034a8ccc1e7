"""Calls from the gateway to safety and the engine, with their failures made actionable."""

from __future__ import annotations

import grpc

from services.common.channels import open_channel
from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ThermoclineError,
    Unavailable,
)
from services.gateway.router import Router
from thermocline.engine.v1 import engine_pb2
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc

# Statuses an upstream returns about the request itself: the caller sees them as they are.
_PASSED_THROUGH: dict[grpc.StatusCode, type[ThermoclineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def upstream_error(service: str, error: grpc.aio.AioRpcError) -> ThermoclineError:
    """The error the client should see when `service` failed with `error`."""
    passed = _PASSED_THROUGH.get(error.code())
    if passed is not None:
        return passed(f"{service}: {error.details()}")
    return Unavailable(f"{service} is unavailable ({error.code().name}: {error.details()}); retry later")


class Upstreams:
    """The engine replicas (through the router) and the safety service."""

    def __init__(self, router: Router, safety_target: str) -> None:
        self.router = router
        self._safety_channel = open_channel(safety_target)
        self.safety = safety_pb2_grpc.SafetyServiceStub(self._safety_channel)
        self._model_info: engine_pb2.GetModelInfoResponse | None = None

    async def model_info(self, timeout_s: float | None) -> engine_pb2.GetModelInfoResponse:
        """The engine's model description, fetched once."""
        if self._model_info is None:
            try:
                self._model_info = await self.router.any_serving().stub.GetModelInfo(
                    engine_pb2.GetModelInfoRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as error:
                raise upstream_error("engine", error) from None
        return self._model_info

    async def count_tokens(self, request: engine_pb2.CountTokensRequest, timeout_s: float) -> int:
        """Prompt tokens as an engine replica counts them: serving replicas first, and the next one
        when a replica answers UNAVAILABLE (draining before its health watch says so)."""
        replicas = self.router.replicas
        ordered = [r for r in replicas if r.is_serving] + [r for r in replicas if not r.is_serving]
        last_error: grpc.aio.AioRpcError | None = None
        for replica in ordered:
            try:
                reply = await replica.stub.CountTokens(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise upstream_error("engine", error) from None
                last_error = error
                continue
            return int(reply.num_tokens)
        assert last_error is not None  # the router always holds at least one replica
        raise upstream_error("engine", last_error)

    async def check_prompt(self, text: str, tenant: str, timeout_s: float) -> safety_pb2.CheckResponse:
        """The safety service's verdict on a prompt."""
        try:
            return await self.safety.CheckPrompt(
                safety_pb2.CheckPromptRequest(text=text, tenant=tenant), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise upstream_error("safety", error) from None

    async def check_output(
        self, text: str, prompt: str, tenant: str, timeout_s: float
    ) -> safety_pb2.CheckResponse:
        """The safety service's verdict on generated text."""
        try:
            return await self.safety.CheckOutput(
                safety_pb2.CheckOutputRequest(text=text, prompt=prompt, tenant=tenant), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise upstream_error("safety", error) from None

    async def close(self) -> None:
        """Closes the channels and stops following the replicas."""
        await self.router.close()
        await self._safety_channel.close(grace=None)
