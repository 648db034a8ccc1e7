"""Every RPC of every service, called with raw bytes, and what an answer to fuzz may and may not be.

The calls go through gRPC's generic multicallables with no serializer, so a test can send bytes that
no generated stub would produce. `Outcome` is what came back: a status code, its details, and how
many response messages arrived before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import grpc
from google.protobuf.message import DecodeError, Message

from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2
from thermocline.kvstore.v1 import kvstore_pb2
from thermocline.safety.v1 import safety_pb2

Kind = Literal["unary_unary", "unary_stream", "stream_unary"]

# A fault is an answer no request may get: an unhandled exception (UNKNOWN, INTERNAL), a service
# that died or stopped listening (UNAVAILABLE), or one that never answered (DEADLINE_EXCEEDED).
FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Long enough for the slowest legitimate answer here (a stories260K generation to its context limit
# behind the output screen), short enough that a hang fails the test instead of the suite's timeout.
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Rpc:
    """One method of one service."""

    service: str
    package: str
    method: str
    request: type[Message]
    kind: Kind

    @property
    def path(self) -> str:
        """The method's HTTP/2 path."""
        return f"/thermocline.{self.service}.v1.{self.package}/{self.method}"

    @property
    def name(self) -> str:
        """service.Method, for test ids and reports."""
        return f"{self.service}.{self.method}"

    def parses(self, payload: bytes) -> bool:
        """Whether the service's request type accepts these bytes (strings must be valid UTF-8)."""
        try:
            self.request.FromString(payload)
        except DecodeError:
            return False
        return True


RPCS = (
    Rpc("gateway", "GatewayService", "Generate", gateway_pb2.GenerateRequest, "unary_stream"),
    Rpc("gateway", "GatewayService", "ListModels", gateway_pb2.ListModelsRequest, "unary_unary"),
    Rpc("engine", "EngineService", "Generate", engine_pb2.GenerateRequest, "unary_stream"),
    Rpc("engine", "EngineService", "GetStats", engine_pb2.GetStatsRequest, "unary_unary"),
    Rpc("engine", "EngineService", "GetModelInfo", engine_pb2.GetModelInfoRequest, "unary_unary"),
    Rpc("engine", "EngineService", "CountTokens", engine_pb2.CountTokensRequest, "unary_unary"),
    Rpc("safety", "SafetyService", "CheckPrompt", safety_pb2.CheckPromptRequest, "unary_unary"),
    Rpc("safety", "SafetyService", "CheckOutput", safety_pb2.CheckOutputRequest, "unary_unary"),
    Rpc("safety", "SafetyService", "GetGate", safety_pb2.GetGateRequest, "unary_unary"),
    Rpc("kvstore", "KVStoreService", "PutBlocks", kvstore_pb2.PutBlocksRequest, "stream_unary"),
    Rpc("kvstore", "KVStoreService", "GetBlocks", kvstore_pb2.GetBlocksRequest, "unary_stream"),
    Rpc("kvstore", "KVStoreService", "Lookup", kvstore_pb2.LookupRequest, "unary_unary"),
    Rpc("kvstore", "KVStoreService", "Prefetch", kvstore_pb2.PrefetchRequest, "unary_unary"),
    Rpc("kvstore", "KVStoreService", "Delete", kvstore_pb2.DeleteRequest, "unary_unary"),
    Rpc("kvstore", "KVStoreService", "GetStats", kvstore_pb2.GetStatsRequest, "unary_unary"),
)
RPC_BY_NAME = {rpc.name: rpc for rpc in RPCS}


@dataclass(frozen=True)
class Outcome:
    """How one call ended."""

    code: grpc.StatusCode
    details: str
    responses: tuple[bytes, ...]

    @property
    def is_fault(self) -> bool:
        """Whether the answer is one no request may get."""
        return self.code in FAULT_CODES

    def describe(self) -> str:
        """The status and its message, for assertion messages."""
        return f"{self.code.name}: {self.details[:300]!r}"


# How many calls each RPC got and how they ended; bench/fuzz.py reports it.
CALLS: Counter[tuple[str, str]] = Counter()


def invoke(
    channel: grpc.Channel,
    rpc: Rpc,
    payloads: list[bytes],
    metadata: list[tuple[str, str | bytes]] | None = None,
    timeout_s: float = CALL_TIMEOUT_S,
) -> Outcome:
    """Sends raw request bytes (one message, or a stream for client-streaming RPCs) and reads the end."""
    try:
        responses = tuple(_call(channel, rpc, payloads, metadata or [], timeout_s))
        outcome = Outcome(grpc.StatusCode.OK, "", responses)
    except grpc.RpcError as error:
        outcome = Outcome(error.code(), error.details() or "", ())
    CALLS[(rpc.name, outcome.code.name)] += 1
    return outcome


def _call(
    channel: grpc.Channel,
    rpc: Rpc,
    payloads: list[bytes],
    metadata: list[tuple[str, str | bytes]],
    timeout_s: float,
) -> Iterator[bytes]:
    if rpc.kind == "unary_unary":
        yield channel.unary_unary(rpc.path)(payloads[0], metadata=metadata, timeout=timeout_s)
    elif rpc.kind == "unary_stream":
        yield from channel.unary_stream(rpc.path)(payloads[0], metadata=metadata, timeout=timeout_s)
    else:
        yield channel.stream_unary(rpc.path)(iter(payloads), metadata=metadata, timeout=timeout_s)
