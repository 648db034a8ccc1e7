"""Fuzzing every RPC of every service through the real mesh: each call ends with a status, no status
says the service faulted (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED, DATA_LOSS), and the
service is still up and SERVING after it.

Four kinds of input per RPC: well-formed requests with every field on or past its limits; valid
encodings with bytes damaged; arbitrary bytes; and well-formed requests with fuzzed metadata (the
keys the services read, repeated, oversized, odd or unknown, and a valid token damaged). Bytes
that the request type cannot parse must be refused with INVALID_ARGUMENT. The kvstore comes last
and only through its public RPCs.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import event, given
from hypothesis import strategies as st

from services.cli.client import call_metadata
from services.cli.mesh import Mesh
from tests.fuzz.conftest import FUZZ_SETTINGS
from tests.fuzz.rpcs import RPC_BY_NAME, RPCS, Outcome, Rpc, invoke
from tests.fuzz.strategies import call_metadata_sets, mutated, structured
from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2

RPC_NAMES = [rpc.name for rpc in RPCS]


def call(
    channels: dict[str, grpc.Channel],
    mesh: Mesh,
    token: str,
    rpc: Rpc,
    payloads: list[bytes],
    metadata: list[tuple[str, str | bytes]] | None = None,
) -> Outcome:
    """One fuzz call, then the checks every call shares: the service's process lives and serves."""
    if metadata is None:
        metadata = call_metadata(token) if rpc.service == "gateway" else []
    outcome = invoke(channels[rpc.service], rpc, payloads, metadata)
    process = mesh.processes[rpc.service]
    assert process.poll() is None, f"{rpc.service} exited ({process.returncode}) after {outcome.describe()}"
    health = health_pb2_grpc.HealthStub(channels[rpc.service])
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING, f"{rpc.service} stopped serving"
    return outcome


def check_completed_stream(rpc: Rpc, outcome: Outcome) -> None:
    """A Generate stream that ended OK ended with its final message, and not with an engine error:
    a request the service accepted must not fail inside it (one tenant's bad values poisoning a step)."""
    if rpc.method != "Generate" or outcome.code != grpc.StatusCode.OK:
        return
    assert outcome.responses, "an OK stream must send its final message"
    if rpc.service == "gateway":
        last = gateway_pb2.GenerateResponse.FromString(outcome.responses[-1])
        assert last.HasField("done"), "an OK stream must end with its Completion"
        assert last.done.finish_reason != gateway_pb2.FINISH_REASON_ERROR, (
            "admitted, then failed by the engine"
        )
    else:
        final = engine_pb2.GenerateResponse.FromString(outcome.responses[-1])
        assert final.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED, "the stream ended unfinished"
        assert final.finish_reason != engine_pb2.FINISH_REASON_ERROR, "the engine accepted it, then failed it"


@pytest.mark.parametrize("rpc_name", RPC_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_edge_valued_requests_get_a_status_and_no_fault(
    fuzz_channels: dict[str, grpc.Channel],
    fuzz_mesh: Mesh,
    fuzz_token: str,
    rpc_name: str,
    data: st.DataObject,
) -> None:
    rpc = RPC_BY_NAME[rpc_name]
    payloads = data.draw(structured(rpc_name), label="payloads")
    outcome = call(fuzz_channels, fuzz_mesh, fuzz_token, rpc, payloads)
    event(outcome.code.name)
    assert not outcome.is_fault, outcome.describe()
    check_completed_stream(rpc, outcome)


@pytest.mark.parametrize("rpc_name", RPC_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_damaged_encodings_that_still_parse_get_no_fault(
    fuzz_channels: dict[str, grpc.Channel],
    fuzz_mesh: Mesh,
    fuzz_token: str,
    rpc_name: str,
    data: st.DataObject,
) -> None:
    rpc = RPC_BY_NAME[rpc_name]
    payloads = data.draw(mutated(structured(rpc_name)), label="payloads")
    outcome = call(fuzz_channels, fuzz_mesh, fuzz_token, rpc, payloads)
    if all(rpc.parses(p) for p in payloads):  # the unparseable ones are the next test's
        event(outcome.code.name)
        assert not outcome.is_fault, outcome.describe()
        check_completed_stream(rpc, outcome)


def unparseable(rpc: Rpc) -> st.SearchStrategy[bytes]:
    """Bytes the request type rejects: damaged valid encodings, arbitrary bytes, bad UTF-8."""
    damaged = mutated(structured(rpc.name)).flatmap(
        lambda ps: st.sampled_from(ps) if ps else st.just(b"\xff")
    )
    bad_utf8 = st.binary(min_size=1, max_size=8).map(lambda b: b"\x0a" + bytes([len(b) + 1]) + b"\xff" + b)
    return (damaged | st.binary(min_size=1, max_size=2048) | bad_utf8).filter(lambda b: not rpc.parses(b))


@pytest.mark.parametrize("rpc_name", RPC_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_unparseable_bytes_are_refused_as_invalid_argument(
    fuzz_channels: dict[str, grpc.Channel],
    fuzz_mesh: Mesh,
    fuzz_token: str,
    rpc_name: str,
    data: st.DataObject,
) -> None:
    rpc = RPC_BY_NAME[rpc_name]
    payload = data.draw(unparseable(rpc), label="payload")
    outcome = call(fuzz_channels, fuzz_mesh, fuzz_token, rpc, [payload])
    event(outcome.code.name)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome.describe()


@pytest.mark.parametrize("rpc_name", RPC_NAMES)
@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzzed_metadata_gets_a_status_and_no_fault(
    fuzz_channels: dict[str, grpc.Channel],
    fuzz_mesh: Mesh,
    fuzz_token: str,
    rpc_name: str,
    data: st.DataObject,
) -> None:
    rpc = RPC_BY_NAME[rpc_name]
    payloads = data.draw(structured(rpc_name), label="payloads")
    metadata = data.draw(call_metadata_sets(fuzz_token), label="metadata")
    outcome = call(fuzz_channels, fuzz_mesh, fuzz_token, rpc, payloads, metadata)
    event(outcome.code.name)
    assert not outcome.is_fault, outcome.describe()
    check_completed_stream(rpc, outcome)
