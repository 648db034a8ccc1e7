"""Hypothesis strategies for every request message, weighted towards the values at each field's limits.

Strings run from empty to tens of KiB (and through the whole of Unicode), integers sit on their
type's edges and on the model's (vocabulary size, context length), floats include NaN, the
infinities, negative zero and subnormals. `mutated` takes a valid encoding and damages it the way a
broken client or a hostile one would.
"""

from __future__ import annotations

from hypothesis import strategies as st

from thermocline.engine.v1 import engine_pb2
from thermocline.gateway.v1 import gateway_pb2
from thermocline.kvstore.v1 import kvstore_pb2
from thermocline.safety.v1 import safety_pb2

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# Sizes around the limits a service may set on a string (names, ids, stop strings) and past them.
EDGE_LENGTHS = (0, 1, 63, 64, 65, 255, 256, 257, 1024, 4096, 16384, 65536)
# stories260K, the fuzz mesh's model: 512 token ids, a 512-token context.
VOCAB_SIZE = 512
CONTEXT_TOKENS = 512


def edge_uint32(*model_edges: int) -> st.SearchStrategy[int]:
    """A uint32 on an edge of its type or of the model, or anywhere in range."""
    edges = {0, 1, 2, UINT32_MAX - 1, UINT32_MAX, 2**31 - 1, 2**31}
    edges |= {e + d for e in model_edges for d in (-1, 0, 1) if 0 <= e + d <= UINT32_MAX}
    return st.sampled_from(sorted(edges)) | st.integers(0, UINT32_MAX)


def edge_floats() -> st.SearchStrategy[float]:
    """Floats that break naive range checks, and the ordinary ones between."""
    specials = [0.0, -0.0, 1e-45, 1e-40, 1e-38, 1e-3, 0.999, 1.0, 1.0001, 2.0, 100.0, 100.5, 3.4e38]
    specials += [float("nan"), float("inf"), float("-inf"), -1.0, -1e-40]
    return st.sampled_from(specials) | st.floats(width=32)


def edge_text(max_size: int = 64) -> st.SearchStrategy[str]:
    """Short text from all of Unicode, or ASCII at one of the edge lengths."""
    sized = st.sampled_from(EDGE_LENGTHS).flatmap(lambda n: st.just("a" * n))
    control = st.text(alphabet=st.characters(codec="ascii", categories=["Cc"]), max_size=8)
    return st.text(max_size=max_size) | sized | control | st.sampled_from(["\n", "a\n", " ", "\x00"])


def stop_lists() -> st.SearchStrategy[list[str]]:
    """Stop strings: none, a few, many, empty ones and long ones."""
    many = st.integers(0, 300).map(lambda n: [f"s{i}" for i in range(n)])
    return st.lists(edge_text(16), max_size=8) | many


def gateway_sampling() -> st.SearchStrategy[gateway_pb2.SamplingOptions]:
    """SamplingOptions with every field on or past a limit."""
    return st.builds(
        gateway_pb2.SamplingOptions,
        max_tokens=edge_uint32(CONTEXT_TOKENS) | st.integers(0, 24),
        temperature=edge_floats(),
        top_p=edge_floats(),
        top_k=edge_uint32(VOCAB_SIZE),
        seed=st.none() | st.sampled_from([0, 1, UINT64_MAX]) | st.integers(0, UINT64_MAX),
        stop=stop_lists(),
    )


def gateway_chat() -> st.SearchStrategy[gateway_pb2.ChatTurns]:
    """Chats with real and made-up roles, empty turns and many turns."""
    role = st.sampled_from(["system", "user", "assistant", "tool", ""]) | edge_text(16)
    message = st.builds(gateway_pb2.ChatMessage, role=role, content=edge_text())
    return st.builds(gateway_pb2.ChatTurns, messages=st.lists(message, max_size=40))


@st.composite
def gateway_generate(draw: st.DrawFn) -> gateway_pb2.GenerateRequest:
    """Gateway GenerateRequests: prompt, chat or neither; any model name; any sampling."""
    model = draw(st.sampled_from(["", "stories260k", "STORIES260K", "../stories260k"]) | edge_text())
    request = gateway_pb2.GenerateRequest(model=model)
    if (sampling := draw(st.none() | gateway_sampling())) is not None:
        request.sampling.CopyFrom(sampling)
    form = draw(st.sampled_from(["prompt", "chat", "none"]))
    if form == "prompt":
        request.prompt = draw(edge_text())
    elif form == "chat":
        request.chat.CopyFrom(draw(gateway_chat()))
    return request


def engine_sampling() -> st.SearchStrategy[engine_pb2.SamplingParams]:
    """SamplingParams with every field on or past a limit."""
    return gateway_sampling().map(lambda o: engine_pb2.SamplingParams.FromString(o.SerializeToString()))


def engine_generate() -> st.SearchStrategy[engine_pb2.GenerateRequest]:
    """Engine GenerateRequests, including token ids past the vocabulary and prompts past the context."""
    ids = st.lists(edge_uint32(VOCAB_SIZE), max_size=16) | st.sampled_from(
        [CONTEXT_TOKENS - 1, CONTEXT_TOKENS, CONTEXT_TOKENS + 1, 4 * CONTEXT_TOKENS]
    ).map(lambda n: [1] * n)
    intent = st.sampled_from(["", "critical", "interactive", "standard", "batch", "default"]) | edge_text(16)
    inputs = st.one_of(
        st.builds(lambda p: {"prompt": p}, edge_text()),
        st.builds(lambda c: {"chat": engine_pb2.ChatTurns.FromString(c.SerializeToString())}, gateway_chat()),
        st.builds(lambda i: {"token_ids": engine_pb2.TokenIds(ids=i)}, ids),
        st.just({}),
    )
    return st.builds(
        lambda fields, **rest: engine_pb2.GenerateRequest(**fields, **rest),
        inputs,
        request_id=edge_text(),
        sampling=st.none() | engine_sampling(),
        intent_class=intent,
        cache_salt=edge_text(),
    )


def check_prompt() -> st.SearchStrategy[safety_pb2.CheckPromptRequest]:
    """Prompts to screen, up to 64 KiB, with any tenant."""
    return st.builds(safety_pb2.CheckPromptRequest, text=edge_text(256), tenant=edge_text(32))


def check_output() -> st.SearchStrategy[safety_pb2.CheckOutputRequest]:
    """Outputs to screen, with or without their prompt."""
    return st.builds(
        safety_pb2.CheckOutputRequest, text=edge_text(256), prompt=edge_text(), tenant=edge_text(32)
    )


def get_gate() -> st.SearchStrategy[safety_pb2.GetGateRequest]:
    """Both forms of GetGate."""
    return st.builds(safety_pb2.GetGateRequest, metadata_only=st.booleans())


def block_hashes() -> st.SearchStrategy[list[str]]:
    """Hash lists: none, hex, not hex, duplicates, and many."""
    hex_hash = st.binary(min_size=0, max_size=70).map(bytes.hex)  # valid from 4 to 64 bytes
    many = st.integers(0, 5000).map(lambda n: [f"{i:064x}" for i in range(n)])
    return st.lists(hex_hash, max_size=16) | st.lists(hex_hash | edge_text(), max_size=16) | many


def namespaces() -> st.SearchStrategy[kvstore_pb2.Namespace | None]:
    """A valid namespace (so calls get past it to the hashes), or an absent or edge-valued one."""
    valid = st.builds(
        kvstore_pb2.Namespace, tenant=st.sampled_from(["fuzz", "acme"]), model=st.just("stories260k")
    )
    return valid | st.none() | st.builds(kvstore_pb2.Namespace, tenant=edge_text(), model=edge_text())


def block_headers() -> st.SearchStrategy[kvstore_pb2.BlockHeader]:
    """Headers with unknown codecs, absurd shapes and payload sizes that match nothing."""
    return st.builds(
        kvstore_pb2.BlockHeader,
        block_hash=st.binary(min_size=4, max_size=32).map(bytes.hex) | edge_text(),
        codec=st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1]),
        shape=st.lists(edge_uint32(), max_size=6),
        payload_bytes=st.sampled_from([0, 1, 4096, UINT64_MAX]) | st.integers(0, UINT64_MAX),
    )


def put_blocks_messages() -> st.SearchStrategy[kvstore_pb2.PutBlocksRequest]:
    """One PutBlocks message: any mix of namespace, header and data."""
    return st.builds(
        kvstore_pb2.PutBlocksRequest,
        namespace=namespaces(),
        header=st.none() | block_headers(),
        data=st.binary(max_size=4096),
    )


def kvstore_requests(method: str) -> st.SearchStrategy[list[bytes]]:
    """Encoded requests for one kvstore method (a short stream of them for PutBlocks)."""
    if method == "PutBlocks":
        encoded = put_blocks_messages().map(lambda r: r.SerializeToString())
        return st.lists(encoded, min_size=0, max_size=6)
    if method == "GetStats":
        return st.just([b""])
    message = {
        "GetBlocks": kvstore_pb2.GetBlocksRequest,
        "Lookup": kvstore_pb2.LookupRequest,
        "Prefetch": kvstore_pb2.PrefetchRequest,
        "Delete": kvstore_pb2.DeleteRequest,
    }[method]
    requests = st.builds(message, namespace=namespaces(), block_hashes=block_hashes())
    return requests.map(lambda request: [request.SerializeToString()])


def structured(rpc_name: str) -> st.SearchStrategy[list[bytes]]:
    """Well-formed, edge-valued encodings of one RPC's request (a list: a stream for PutBlocks)."""
    service, method = rpc_name.split(".")
    if service == "kvstore":
        return kvstore_requests(method)
    messages = {
        "gateway.Generate": gateway_generate(),
        "engine.Generate": engine_generate(),
        "safety.CheckPrompt": check_prompt(),
        "safety.CheckOutput": check_output(),
        "safety.GetGate": get_gate(),
    }
    empty = st.just(b"")  # the request types with no fields: ListModels, GetStats, GetModelInfo
    strategy = messages.get(rpc_name)
    encoded = strategy.map(lambda m: m.SerializeToString()) if strategy is not None else empty
    return encoded.map(lambda payload: [payload])


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[list[bytes]]) -> list[bytes]:
    """A valid encoding with bytes flipped, inserted, deleted, truncated or duplicated."""
    payloads = draw(valid)
    if not payloads:
        return payloads
    index = draw(st.integers(0, len(payloads) - 1))
    data = payloads[index]
    for _ in range(draw(st.integers(1, 4))):
        data = _mutate_once(draw, data)
    payloads[index] = data
    return payloads


def _mutate_once(draw: st.DrawFn, data: bytes) -> bytes:
    action = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "duplicate", "overlong"]))
    at = draw(st.integers(0, len(data)))
    if action == "flip" and data:
        at = min(at, len(data) - 1)
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    if action == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if action == "delete":
        return data[:at] + data[at + draw(st.integers(1, 8)) :]
    if action == "truncate":
        return data[:at]
    if action == "duplicate":
        return data + data
    if action == "overlong":  # a length prefix that claims more bytes than follow
        return data[:at] + bytes([0x12, 0xFF, 0xFF, 0x03]) + data[at:]
    return data


# The metadata keys the services read, and the token's own limit (services/gateway/auth.py).
READ_METADATA_KEYS = (
    "authorization",
    "x-intent",
    "x-request-id",
    "x-retrieval-mode",
    "traceparent",
    "tracestate",
)
MAX_TOKEN_CHARS = 16 * 1024
# Text metadata is printable ASCII on the wire (grpc refuses to send anything else).
_ASCII_VALUE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


def metadata_values() -> st.SearchStrategy[str]:
    """A text metadata value: short and odd, or ASCII at one of the edge lengths up to a token's limit."""
    sized = st.sampled_from((*EDGE_LENGTHS[:-1], MAX_TOKEN_CHARS - 1, MAX_TOKEN_CHARS, MAX_TOKEN_CHARS + 1))
    shaped = st.sampled_from(
        ["Bearer", "Bearer ", "bearer x", "Basic dXNlcjpwdw==", "Bearer a.b.c", "Bearer eyJ.eyJ.x", " ", "00"]
    )
    return st.text(alphabet=_ASCII_VALUE, max_size=64) | shaped | sized.map(lambda n: "a" * n)


def token_variants(token: str) -> st.SearchStrategy[str]:
    """An authorization value built from a valid token: as is, cut, with a character changed, or doubled."""
    at = st.integers(0, len(token) - 1)
    changed = at.map(lambda i: token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :])
    variants = st.just(token) | at.map(lambda i: token[:i]) | changed | st.just(token + "." + token)
    return variants.map(lambda t: f"Bearer {t}")


@st.composite
def call_metadata_sets(draw: st.DrawFn, token: str) -> list[tuple[str, str | bytes]]:
    """Metadata for one call: the keys the services read (repeated or not), unknown keys, `-bin` bytes."""
    known = st.tuples(st.sampled_from(READ_METADATA_KEYS), metadata_values())
    authorization = st.tuples(st.just("authorization"), token_variants(token))
    unknown_key = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=32)
    unknown = st.tuples(unknown_key.map(lambda k: "x-fuzz-" + k), metadata_values())
    binary = st.tuples(unknown_key.map(lambda k: "x-fuzz-" + k + "-bin"), st.binary(max_size=256))
    return draw(st.lists(known | authorization | unknown | binary, max_size=6))
