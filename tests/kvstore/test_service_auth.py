"""The kvstore serves the mesh's services only: a call without the service token, or with another
one, is UNAUTHENTICATED and names the setting; health stays open for the probes."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.service_auth import TOKEN_FILE_SETTING, ServiceToken, authenticated
from tests.kvstore.conftest import KVStoreProcess, RedisServer, raw_block
from thermocline.kvstore.v1 import kvstore_pb2 as pb
from thermocline.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

NAMESPACE = pb.Namespace(tenant="tenant-a", model="tiny-llama")
WRONG_TOKEN = ServiceToken("f" * 64, Path("/nowhere"))


def refusal(call: object) -> grpc.RpcError:
    """The error a call raised, which must be UNAUTHENTICATED naming the token's setting."""
    assert isinstance(call, grpc.RpcError)
    assert call.code() == grpc.StatusCode.UNAUTHENTICATED, call
    assert TOKEN_FILE_SETTING in call.details()
    return call


def calls(channel: grpc.Channel) -> None:
    """One unary call and one of each streaming kind, every one of which must be refused."""
    stub = pb_grpc.KVStoreServiceStub(channel)
    with pytest.raises(grpc.RpcError) as lookup:
        stub.Lookup(pb.LookupRequest(namespace=NAMESPACE, block_hashes=["00" * 32]), timeout=30)
    refusal(lookup.value)
    with pytest.raises(grpc.RpcError) as get:
        list(stub.GetBlocks(pb.GetBlocksRequest(namespace=NAMESPACE, block_hashes=["00" * 32]), timeout=30))
    refusal(get.value)
    with pytest.raises(grpc.RpcError) as put:
        stub.PutBlocks(iter([pb.PutBlocksRequest(namespace=NAMESPACE)]), timeout=30)
    refusal(put.value)


def test_a_call_without_the_token_is_refused(shared_kvstore: KVStoreProcess) -> None:
    with grpc.insecure_channel(shared_kvstore.target) as channel:
        calls(channel)


def test_a_call_with_another_token_is_refused(shared_kvstore: KVStoreProcess) -> None:
    with authenticated(grpc.insecure_channel(shared_kvstore.target), WRONG_TOKEN) as channel:
        calls(channel)


def test_a_call_with_the_token_is_served(shared_kvstore: KVStoreProcess) -> None:
    block = raw_block("service-auth")
    with shared_kvstore.client() as client:
        assert client.put([block]).stored == [block.block_hash]
        assert client.lookup([block.block_hash]) == [block.block_hash]


def test_health_answers_without_a_token(shared_kvstore: KVStoreProcess) -> None:
    with grpc.insecure_channel(shared_kvstore.target) as channel:
        for name in ("", "thermocline.kvstore.v1.KVStoreService"):
            request = health_pb2.HealthCheckRequest(service=name)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_token_beyond_loopback_refuses_to_start(tmp_path: Path, redis_server: RedisServer) -> None:
    """Listening on every address without a token would hand any tenant's blocks to the network."""
    env = {"THERMOCLINE_KVSTORE_HOST": "0.0.0.0", TOKEN_FILE_SETTING: ""}
    process = KVStoreProcess(tmp_path / "kvstore", redis_server.url, env)
    assert process.start_or_exit() not in (None, 0)
    assert TOKEN_FILE_SETTING in process.log_tail()
