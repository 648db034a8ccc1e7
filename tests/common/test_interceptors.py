"""Every service of a real mesh answers a request that does not parse with INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest

from services.cli.mesh import Mesh

GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: no such wire type
NOT_UTF8 = b"\x0a\x01\xff"  # field 1 (a string in each message below) holding the byte 0xff

CALLS = [
    ("gateway", "/thermocline.gateway.v1.GatewayService/ListModels", "unary"),
    ("gateway", "/thermocline.gateway.v1.GatewayService/Generate", "server-stream"),
    ("engine", "/thermocline.engine.v1.EngineService/GetStats", "unary"),
    ("engine", "/thermocline.engine.v1.EngineService/Generate", "server-stream"),
    ("safety", "/thermocline.safety.v1.SafetyService/CheckPrompt", "unary"),
    ("kvstore", "/thermocline.kvstore.v1.KVStoreService/Lookup", "unary"),
    ("kvstore", "/thermocline.kvstore.v1.KVStoreService/PutBlocks", "client-stream"),
]


def _call(channel: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.RpcError:
    try:
        if kind == "unary":
            channel.unary_unary(method)(payload, timeout=30)
        elif kind == "server-stream":
            list(channel.unary_stream(method)(payload, timeout=30))
        else:
            channel.stream_unary(method)(iter([payload]), timeout=30)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{method} accepted {payload!r}")


# invalid UTF-8 where field 1 is a string: the gateway's model, the engine's request id, the prompt
STRING_FIELD_CALLS = [c for c in CALLS if c[1].endswith(("Service/Generate", "CheckPrompt"))]
CASES = [(*c, GARBAGE) for c in CALLS] + [(*c, NOT_UTF8) for c in STRING_FIELD_CALLS]


@pytest.mark.parametrize(("service", "method", "kind", "payload"), CASES)
def test_an_unparseable_request_is_invalid_argument(
    stories_mesh: Mesh, service: str, method: str, kind: str, payload: bytes
) -> None:
    with stories_mesh.channel(service) as channel:
        error = _call(channel, method, kind, payload)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert "not a valid protobuf message" in error.details()
