"""A new prompt's stored prefix, fetched from the kvstore into one block-major host buffer.

A prefix hit is one long read: every stored prompt block of a prompt, in order, BF16 (CODEC_RAW).
Its blocks land in one buffer `[n, L, 2, BS, KVH, D]` (pinned for a CUDA engine), each payload
written in place, so the engine thread gets a view it copies to the device once and scatters there;
no block becomes a Python object or a tensor of its own.

The buffer is the fetcher's for the engine's life (`reserve`, at start-up, sized for a
`max_seq_len` prompt): page-locking it per hit cost 1.7 of a 2.2 s hit of a 32K-token 8B prefix
on the H200 (bench/results/cold_tier_h200_2026-12-03_breakdown.md). A hit's blocks are a view of
it, handed to the engine thread with a `StagingLease`; the next hit reuses the buffer only once
the lease says nobody reads the view any more (the sequence let the prefix go, and the device
copies out of it have run). A hit that finds it still leased, or too small, gets a buffer of its
own, as every hit did before.

Two ways in, the first preferred when it is on (`ColdTierConfig.local_reads`):
- **same-host reads:** LocateBlocks (which also says which blocks are present: it replaces the
  Lookup) gives each record's place; the engine reads the segment files itself on a pool of
  threads and checks every record (services/common/segment_reader.py). From the first record
  that fails (a stale location, a file it cannot see, a flipped byte), the rest goes by the stream;
- **the GetBlocks stream:** Lookup, then each chunk's bytes copied straight into the buffer.
A store that refuses locations (not set to hand them out, or too old to know the RPC) turns
same-host reads off for this engine's life, after one warning.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import torch

from services.common.kvstore_api import BlockLocation, CallOptions, Codec, KVStoreClient, MissReason
from services.common.segment_reader import ExpectedRecord, SegmentReader

logger = logging.getLogger(__name__)

MAX_READ_THREADS = 16  # same-host readers; page-cache copies and CRCs scale about to the core count
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)  # no locations here
BF16_BYTES = 2


@dataclass(frozen=True)
class PrefixLayout:
    """How a prefix's blocks land on the host: `[n, *block_shape]` BF16, pinned for a CUDA engine."""

    block_shape: tuple[int, ...]  # [L, 2, BS, KVH, D]: a stored prompt block (CODEC_RAW)
    pin_memory: bool = False

    @property
    def payload_bytes(self) -> int:
        """One block's BF16 payload."""
        return math.prod(self.block_shape) * BF16_BYTES


class StagingLease:
    """Who still reads a fetched prefix's host buffer: the sequence that holds it (from the fetch)
    and each load queued out of it (`hold`), each until it `drop`s. The buffer may be written again
    once nobody holds it and the device copies out of it that were dropped with an event have run.
    Any thread may call it; a holder that never drops only costs the next hit a buffer of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 1  # the fetch's own, passed to the sequence that takes the prefix
        self._copies: list[torch.cuda.Event] = []

    def hold(self) -> None:
        """One more reader (a load queued out of the buffer)."""
        with self._lock:
            self._holders += 1

    def drop(self, copied: torch.cuda.Event | None = None) -> None:
        """A reader is done; `copied`: its device copies are queued and end with this event."""
        with self._lock:
            self._holders -= 1
            if copied is not None:
                self._copies.append(copied)

    def is_released(self) -> bool:
        """Nobody holds the buffer (its copies may still be running: `wait_for_copies`)."""
        with self._lock:
            return self._holders <= 0

    def wait_for_copies(self) -> None:
        """Block until the device copies out of the buffer have run."""
        with self._lock:
            copies, self._copies = self._copies, []
        for event in copies:
            event.synchronize()

    def __reduce__(self) -> tuple[object, tuple[()]]:
        # Step plans are pickled to TP followers. The cold tier runs at TP 1 only today (LLMEngine.load
        # turns it off above), but a load that does travel carries a copy of its blocks (read before
        # rank 0 drops its hold) and no lease, which stays with rank 0's buffer and its lock.
        return _no_lease, ()


def _no_lease() -> None:
    return None


class FetchedPrefix(NamedTuple):
    """The leading run of a prompt's blocks that came back intact, and how."""

    kv: torch.Tensor  # [n, L, 2, BS, KVH, D] BF16 on the host
    num_read_locally: int  # of the n, read from the segment files by this process
    first_bad: str | None  # the first present block not served intact (it ends the run); None: none
    lease: StagingLease  # the holder of `kv`'s buffer (the caller's until it drops it)


class PrefixFetcher:
    """Fetches prefixes for one kvstore client (the loader thread's); `close` stops its readers."""

    def __init__(self, client: KVStoreClient, local_reads: bool) -> None:
        self.client = client
        self.local_reads = local_reads
        self._reader = SegmentReader(min(MAX_READ_THREADS, os.cpu_count() or 1)) if local_reads else None
        self._staging: torch.Tensor | None = None  # [capacity, *block_shape], kept (`reserve`)
        self._staging_lease: StagingLease | None = None  # of the last hit served from it

    def reserve(self, num_blocks: int, layout: PrefixLayout) -> None:
        """Keep a host buffer for prefixes of up to `num_blocks` blocks (pinned for a CUDA engine);
        call before the first fetch. Page-locking happens here, once, not on a hit's path."""
        if num_blocks > 0:
            self._staging = torch.empty(
                (num_blocks, *layout.block_shape), dtype=torch.bfloat16, pin_memory=layout.pin_memory
            )

    def fetch(
        self, hashes: Sequence[str], layout: PrefixLayout, call: CallOptions, transfer: CallOptions
    ) -> FetchedPrefix:
        """The longest run of `hashes`, from the first, that the store holds and serves intact.
        `call` bounds the lookup, `transfer` the reads."""
        locations = self._locate(hashes, call) if self.local_reads else None
        if locations is None:
            present = set(self.client.lookup(list(hashes), call))
        else:
            present = {b.block_hash for b in locations}
        run = _leading(hashes, present)
        kv, lease = self._host_buffer(len(run), layout)
        try:
            payloads = _payload_views(kv, layout.payload_bytes)
            num_local = (
                self._read_locally(_in_order(run, locations), payloads, transfer, layout) if locations else 0
            )
            num_good = num_local + self._stream(run[num_local:], payloads[num_local:], transfer)
        except BaseException:
            lease.drop()  # nobody will read what landed
            raise
        first_bad = run[num_good] if num_good < len(run) else None
        return FetchedPrefix(kv[:num_good], num_local, first_bad, lease)

    def _host_buffer(self, num_blocks: int, layout: PrefixLayout) -> tuple[torch.Tensor, StagingLease]:
        """Where `num_blocks` blocks land, `[n, *block_shape]` BF16, and its lease: the kept buffer
        when it fits and nobody reads it any more, else a new one (pinned for a CUDA engine)."""
        staging, last = self._staging, self._staging_lease
        fits = staging is not None and staging.shape[1:] == layout.block_shape and num_blocks <= len(staging)
        if staging is not None and fits and (last is None or last.is_released()):
            if last is not None:
                last.wait_for_copies()
            self._staging_lease = StagingLease()
            return staging[:num_blocks], self._staging_lease
        shape = (num_blocks, *layout.block_shape)
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=layout.pin_memory), StagingLease()

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

    def _read_locally(
        self,
        locations: list[BlockLocation],
        payloads: list[memoryview],
        transfer: CallOptions,
        layout: PrefixLayout,
    ) -> int:
        """How many leading blocks were read from the segment files intact."""
        assert self._reader is not None
        namespace = transfer.namespace or self.client.namespace
        expected = ExpectedRecord(namespace.tenant, namespace.model, Codec.RAW, layout.block_shape)
        return self._reader.read_run(locations, payloads[: len(locations)], expected)

    def _stream(self, run: list[str], payloads: list[memoryview], transfer: CallOptions) -> int:
        """How many leading blocks of `run` the GetBlocks stream served intact, into their payloads."""
        if not run:
            return 0
        results = self.client.get_into(run, payloads[: len(run)], transfer)
        return next((i for i, miss in enumerate(results) if isinstance(miss, MissReason)), len(run))

    def close(self) -> None:
        """Stop the reader threads."""
        if self._reader is not None:
            self._reader.close()


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
