"""A new prompt's stored prefix, fetched from the kvstore and written into the hot blocks that wait
for it, piece by piece as it comes.

A prefix hit is one long read: every stored prompt block of a prompt, in order, BF16 (CODEC_RAW).
Its blocks land in one block-major host buffer `[n, L, 2, BS, KVH, D]` (pinned for a CUDA engine),
each payload written in place (no block becomes a Python object or a tensor of its own), and go on
to the device in pieces of PIECE_BLOCKS: a `PrefixSink` (services/engine/kv/cache.py's
PrefixWriter) copies each piece into its hot blocks as soon as its reads are done, while the next
pieces are still being located and read. The blocks reach the cache with the last read, not one
whole copy after it.

The host buffer is the fetcher's for the engine's life (`reserve`, at start-up, sized for a
`max_seq_len` prompt): page-locking it per hit cost 1.7 of a 2.2 s hit of a 32K-token 8B prefix
on the H200 (bench/results/cold_tier_h200_2026-12-03_breakdown.md). A fetch returns only once every
copy out of it has landed, so the next fetch (the same loader thread) may write it again at once. A
prefix longer than the kept buffer gets a buffer of its own.

Two ways in, the first preferred when it is on (`ColdTierConfig.local_reads`):
- **same-host reads:** LocateBlocks, a piece at a time (which also says which blocks are present:
  it replaces the Lookup), gives each record's place; the engine reads the segment files itself on
  a pool of threads and checks every record (services/common/segment_reader.py). From the first
  record that fails (a stale location, a file it cannot see, a flipped byte), the rest goes by the
  stream;
- **the GetBlocks stream:** Lookup, then each chunk's bytes copied straight into the buffer.
A store that refuses locations (not set to hand them out, or too old to know the RPC) turns
same-host reads off for this engine's life, after one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import grpc
import torch

from services.common.kvstore_api import BlockLocation, CallOptions, Codec, KVStoreClient, MissReason
from services.common.segment_reader import ExpectedRecord, PendingRun, SegmentFiles, SegmentReader

logger = logging.getLogger(__name__)

# Same-host readers: on the H200's 16-vCPU host, 8 read and check 19 GB/s, 12 and 16 only 15
# (memory bandwidth, not cores; bench/results/segment_reads_h200_2026-12-03.md).
MAX_READ_THREADS = 8
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)  # no locations here
BF16_BYTES = 2
# Blocks located, read and handed to the sink as one piece: 128 blocks of the 8B shape are 268 MB,
# about 20 ms of same-host reads on the H200 (so the first copy starts early) and one LocateBlocks
# call of a few ms (so the reads start early).
PIECE_BLOCKS = 128


@dataclass(frozen=True)
class PrefixLayout:
    """How a prefix's blocks land on the host: `[n, *block_shape]` BF16, pinned for a CUDA engine."""

    block_shape: tuple[int, ...]  # [L, 2, BS, KVH, D]: a stored prompt block (CODEC_RAW)
    pin_memory: bool = False

    @property
    def payload_bytes(self) -> int:
        """One block's BF16 payload."""
        return math.prod(self.block_shape) * BF16_BYTES


class PrefixSink(Protocol):
    """Where a fetched prefix's blocks go (the KV cache's hot blocks, `KVCache.prefix_writer`)."""

    def write(self, first: int, kv: torch.Tensor) -> None:
        """Blocks `[first, first + n)` of the prefix, `kv` `[n, *block_shape]` on the host; the host
        memory stays as it is until `finish`."""

    def finish(self) -> None:
        """Block until every write has landed."""

    def wait_for(self, fence: torch.cuda.Event) -> None:
        """Make every write go after the device work `fence` ends (without blocking the caller)."""


class FetchedPrefix(NamedTuple):
    """The leading run of a prompt's blocks that came back intact and went to the sink, and how."""

    num_blocks: int  # blocks `[0, n)` of the hashes asked for, written into the sink
    num_read_locally: int  # of the n, read from the segment files by this process
    first_bad: str | None  # the first present block not served intact (it ends the run); None: none


class _Piece(NamedTuple):
    """One piece's reads in flight: blocks `[start, start + count)` of the prefix."""

    start: int
    num_blocks: int
    reads: PendingRun


class PrefixFetcher:
    """Fetches prefixes for one kvstore client (the loader thread's); `close` stops its readers."""

    def __init__(self, client: KVStoreClient, local_reads: bool) -> None:
        self.client = client
        self.local_reads = local_reads
        self._reader = SegmentReader(min(MAX_READ_THREADS, os.cpu_count() or 1)) if local_reads else None
        self._staging: torch.Tensor | None = None  # [capacity, *block_shape], kept (`reserve`)

    def reserve(self, num_blocks: int, layout: PrefixLayout) -> None:
        """Keep a host buffer for prefixes of up to `num_blocks` blocks (pinned for a CUDA engine);
        call before the first fetch. Page-locking happens here, once, not on a hit's path."""
        if num_blocks > 0:
            self._staging = torch.empty(
                (num_blocks, *layout.block_shape), dtype=torch.bfloat16, pin_memory=layout.pin_memory
            )

    def fetch(
        self,
        hashes: Sequence[str],
        layout: PrefixLayout,
        sink: PrefixSink,
        call: CallOptions,
        transfer: CallOptions,
    ) -> FetchedPrefix:
        """Write the longest run of `hashes`, from the first, that the store holds and serves
        intact into `sink`; returns once all of it has landed. `call` bounds the lookups, `transfer`
        the whole fetch (a store that answers lookups at once and streams slowly must not hold
        the request longer than it can afford)."""
        began = time.monotonic()
        kv = self._host_buffer(len(hashes), layout)
        payloads = _payload_views(kv, layout.payload_bytes)
        try:
            num_local: int = 0
            stream_from: int | None = 0  # with no same-host reads, the stream serves it all
            if self.local_reads:
                num_local, stream_from = self._read_locally(
                    hashes, kv, payloads, sink, layout, call, transfer
                )
            if stream_from is None:
                return FetchedPrefix(num_local, num_local, None)
            left = _remaining(transfer, began)
            num_streamed, first_bad = self._stream(
                hashes[stream_from:], payloads[stream_from:], layout, _no_longer_than(call, left), left
            )
            if num_streamed:
                sink.write(stream_from, kv[stream_from : stream_from + num_streamed])
            return FetchedPrefix(stream_from + num_streamed, num_local, first_bad)
        finally:  # nothing reads the host buffer once this returns, and the blocks are in place
            sink.finish()

    def _host_buffer(self, num_blocks: int, layout: PrefixLayout) -> torch.Tensor:
        """Where `num_blocks` blocks land, `[n, *block_shape]` BF16: the kept buffer when it fits,
        else a new one (pinned for a CUDA engine)."""
        staging = self._staging
        if staging is not None and staging.shape[1:] == layout.block_shape and num_blocks <= len(staging):
            return staging[:num_blocks]
        shape = (num_blocks, *layout.block_shape)
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=layout.pin_memory)

    def _read_locally(
        self,
        hashes: Sequence[str],
        kv: torch.Tensor,
        payloads: list[memoryview],
        sink: PrefixSink,
        layout: PrefixLayout,
        call: CallOptions,
        transfer: CallOptions,
    ) -> tuple[int, int | None]:
        """Locate and read the prefix a piece at a time, each piece going to the sink once its reads
        are done (while later pieces are located and read). Returns how many leading blocks were
        read intact and written, and where the stream must go on from (None: the run ended there)."""
        assert self._reader is not None
        namespace = transfer.namespace or self.client.namespace
        expected = ExpectedRecord(namespace.tenant, namespace.model, Codec.RAW, layout.block_shape)
        files = SegmentFiles()
        pending: deque[_Piece] = deque()
        written = 0
        began = time.monotonic()  # the pieces' LocateBlocks share `call`'s one deadline
        try:
            for start in range(0, len(hashes), PIECE_BLOCKS):
                piece = hashes[start : start + PIECE_BLOCKS]
                locations = self._locate(piece, _remaining(call, began))
                if locations is None:  # refused: the stream serves the rest
                    written, failed = self._write_done(pending, kv, sink, written, wait=True)
                    return written, start if failed is None else failed
                run = _leading(piece, {b.block_hash for b in locations})
                if run:
                    reads = self._reader.start(
                        files, _in_order(run, locations), payloads[start : start + len(run)], expected, start
                    )
                    pending.append(_Piece(start, len(run), reads))
                written, failed = self._write_done(pending, kv, sink, written, wait=False)
                if failed is not None:
                    return written, failed
                if len(run) < len(piece):  # the stored prefix ends in this piece
                    break
            return self._write_done(pending, kv, sink, written, wait=True)
        finally:  # no read still writes into the host buffer once this returns
            for left in pending:
                left.reads.wait()
            files.close()

    @staticmethod
    def _write_done(
        pending: deque[_Piece], kv: torch.Tensor, sink: PrefixSink, written: int, wait: bool
    ) -> tuple[int, int | None]:
        """Hand the sink each leading piece whose reads are done (all of them, waiting, when `wait`).
        Returns the blocks written so far, and the first block that failed its read (None: none)."""
        while pending and (wait or pending[0].reads.done()):
            start, num_blocks, reads = pending.popleft()
            num_good = reads.wait()
            if num_good:
                sink.write(start, kv[start : start + num_good])
            written = start + num_good
            if num_good < num_blocks:
                return written, written
        return written, None

    def _locate(self, hashes: Sequence[str], call: CallOptions) -> list[BlockLocation] | None:
        """The present blocks' places; None (and same-host reads off) when the store refuses."""
        try:
            return self.client.locate(list(hashes), call)
        except grpc.RpcError as error:
            if error.code() not in REFUSED:  # type: ignore[attr-defined]
                raise
            logger.warning(
                "the kvstore hands out no record locations (%s); prefix loads use the GetBlocks stream "
                "(set THERMOCLINE_KVSTORE_SERVE_LOCATIONS=true on a kvstore that shares this host)",
                error.details(),  # type: ignore[attr-defined]
            )
            self.local_reads = False
            return None

    def _stream(
        self,
        hashes: Sequence[str],
        payloads: list[memoryview],
        layout: PrefixLayout,
        call: CallOptions,
        transfer: CallOptions,
    ) -> tuple[int, str | None]:
        """Lookup, then the GetBlocks stream into the payloads: how many leading blocks of `hashes`
        came back intact (raw, of the layout's block shape), and the first present one that did not
        (None: none)."""
        run = _leading(hashes, set(self.client.lookup(list(hashes), call))) if hashes else []
        if not run:
            return 0, None
        results = self.client.get_into(run, payloads[: len(run)], layout.block_shape, transfer)
        num_good = next((i for i, miss in enumerate(results) if isinstance(miss, MissReason)), len(run))
        return num_good, run[num_good] if num_good < len(run) else None

    def close(self) -> None:
        """Stop the reader threads."""
        if self._reader is not None:
            self._reader.close()


def _remaining(call: CallOptions, began: float) -> CallOptions:
    """`call` with what is left of its deadline since `began` (a slow store must not cost a long
    prefix one deadline per piece)."""
    if call.timeout_s is None:
        return call
    left = call.timeout_s - (time.monotonic() - began)
    return dataclasses.replace(call, timeout_s=max(left, 1e-3))


def _no_longer_than(call: CallOptions, limit: CallOptions) -> CallOptions:
    """`call`, its deadline cut down to `limit`'s."""
    if limit.timeout_s is None or (call.timeout_s is not None and call.timeout_s <= limit.timeout_s):
        return call
    return dataclasses.replace(call, timeout_s=limit.timeout_s)


def _leading(hashes: Sequence[str], present: set[str]) -> list[str]:
    """The run of `hashes` from the first that are all in `present`."""
    run: list[str] = []
    for block_hash in hashes:
        if block_hash not in present:
            break
        run.append(block_hash)
    return run


def _in_order(run: list[str], locations: list[BlockLocation]) -> list[BlockLocation]:
    """The location of each block of `run`, in its order (the reader checks each record is its block)."""
    by_hash = {location.block_hash: location for location in locations}
    return [by_hash[block_hash] for block_hash in run]


def _payload_views(kv: torch.Tensor, payload_bytes: int) -> list[memoryview]:
    """One writable byte view per block of a contiguous `[n, ...]` BF16 tensor."""
    flat = memoryview(kv.view(-1).view(torch.uint8).numpy().data)  # bf16 has no numpy dtype; bytes do
    return [flat[i * payload_bytes : (i + 1) * payload_bytes] for i in range(kv.shape[0])]
