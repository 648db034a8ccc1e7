"""The cold tier's decisions, on the engine thread: what to store, what to load, what to attend.

Three uses of the kvstore, each falling back to hot + warm when the store is down, slow or wrong:
- **Prefix reuse.** A computed prompt block is stored raw (BF16) under its content hash (chained,
  tenant-salted). A new prompt waits, off the step loop, for a lookup and a get of its longest
  stored prefix past what the hot prefix cache holds. Hot blocks for all of it are allocated when
  the load starts, and the loader thread writes the blocks into them as they come off the store
  (services/engine/kv/prefix_fetch.py); the request then maps them instead of computing them. The
  blocks are the load's alone until its outcome is taken, even when the request is cancelled
  meanwhile: the loader may still be writing them. The wait is bounded by what the request can
  afford (`prefix_load_budget_s`): past it the request stops waiting and computes its prompt.
- **Demotion.** With the auxiliary window on, a warm group that leaves the warm tier is stored
  INT2 instead of being dropped, and its summary key stays in device memory.
- **The auxiliary window** (Quest). Every `score_every_steps` decode steps, the query of one layer
  scores each cold block by its summary; the best `aux_window_tokens` worth are loaded (async) into
  spare hot blocks and mapped at their own positions, so either attention backend reads them as hot.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from services.engine import metrics
from services.engine.kv.block_pool import SCRATCH_BLOCK
from services.engine.kv.block_table import ColdBlock
from services.engine.kv.cache import ColdSource, KVCache
from services.engine.kv.cold_moves import ColdLoad, ColdStore, ColdSummaries, ScoreRow
from services.engine.kv.cold_tier import (
    BlockHash,
    ColdTier,
    ColdTierConfig,
    Degradation,
    Job,
    LoadedBlock,
    Operation,
    Outcome,
    WindowShape,
)
from services.engine.kv.prefix_fetch import PrefixLayout
from services.engine.scheduling.intent_class import IntentClasses
from services.engine.scheduling.sequence import ColdPrefix, RequestId, Sequence

logger = logging.getLogger(__name__)

MAX_REMEMBERED_PREFIX_BLOCKS = 1 << 16  # prompt blocks known stored, so they are not put again
# At most this share of the hot pool is held by prefix loads and by loaded prefixes that wait for
# their request's admission (one load always goes through); past it a new prompt is computed
# instead. Those blocks belong to no running request, so preemption cannot take them back: without
# a bound, a burst of long prefix hits could leave running requests no room to grow.
MAX_PREFIX_LOAD_SHARE = 0.5
# At most this share of its class's queue timeout is a new request held for its stored prefix: the
# hold counts as queue wait, and a store that gives nothing in time must leave the request the
# rest to be admitted and compute its prompt.
PREFIX_LOAD_QUEUE_SHARE = 0.5


@dataclass
class ColdStats:
    """Lifetime counters of the cold tier (blocks, except where named)."""

    prefix_blocks_stored: int = 0
    prefix_blocks_loaded: int = 0
    prompt_tokens_loaded: int = 0
    prefix_blocks_read_locally: int = 0  # fetched from the segment files directly (same-host reads)
    blocks_demoted: int = 0
    window_loads: int = 0
    window_loads_in_time: int = 0  # mapped by the step after they were chosen: nothing waited
    blocks_prefetched: int = 0  # runner-ups of a scoring the kvstore was asked to stage in RAM
    degradations: int = 0


class ColdPlanner:
    """Owns the engine's view of the cold tier; every call runs on the engine thread."""

    def __init__(
        self,
        tier: ColdTier,
        kv_cache: KVCache,
        summaries: ColdSummaries,
        max_prefix_blocks: int = 0,
        classes: IntentClasses | None = None,
    ) -> None:
        self.tier = tier
        self.classes = classes  # their queue timeouts bound prefix loads (None: the config alone)
        self.summaries = summaries
        self.config: ColdTierConfig = tier.config
        self.kv_cache = kv_cache
        self.stats = ColdStats()
        self.num_steps = 0
        # Loads in flight: the prompt blocks asked for and the hot blocks allocated for them, which
        # the loader thread writes; until the outcome is taken (for a cancelled request too).
        self._loading: dict[RequestId, ColdPrefix] = {}
        self._num_load_blocks = 0  # hot blocks of loads in flight and of loaded prefixes not mapped
        self._held: dict[RequestId, Sequence] = {}
        self._window_wanted: dict[RequestId, set[int]] = {}
        self._scored: set[str] = set()  # requests whose window has been scored at least once
        self._window_asked_at: dict[tuple[RequestId, int], int] = {}
        self._prefetched: dict[RequestId, set[str]] = {}  # runner-ups already staged, per request
        self._stored_prefix: OrderedDict[BlockHash, None] = OrderedDict()
        keys = kv_cache.hot.keys  # [L, N, BS, KVH, D]
        self._prefix_layout = PrefixLayout((keys.shape[0], 2, *keys.shape[2:]), keys.device.type == "cuda")
        staging_blocks = min(
            max_prefix_blocks, self.config.prefix_staging_mb * 2**20 // self._prefix_layout.payload_bytes
        )
        if self.config.prefix_reuse and staging_blocks > 0:  # the host buffer hits land in, kept
            tier.reserve_prefix_staging(staging_blocks, self._prefix_layout)

    @property
    def num_load_blocks(self) -> int:
        """Hot blocks held by prefix loads in flight and by loaded prefixes not mapped yet."""
        return self._num_load_blocks

    @property
    def num_held(self) -> int:
        """New requests waiting for their prefix to come back from the store."""
        return len(self._held)

    # --- prefix reuse --------------------------------------------------------------------------

    def start_prefix_load(self, seq: Sequence) -> bool:
        """Ask the store for the prompt's blocks past the hot cache's; True when `seq` waits for them.

        Hot blocks for every block asked for are allocated here, so that the blocks land in place as
        they come. With no room for them, or when loads would hold more than MAX_PREFIX_LOAD_SHARE of
        the pool, the prompt is computed.
        """
        if not self.config.prefix_reuse:
            return False
        max_blocks = (len(seq.prompt_ids) - 1) // self.kv_cache.block_size
        hashes = seq.block_table.prefix_hashes[:max_blocks]
        pool = self.kv_cache.hot.pool
        first = pool.num_cached_prefix(hashes)
        wanted = len(hashes) - first
        if first >= len(hashes) or not pool.can_allocate(wanted):
            return False
        if self._num_load_blocks and self._num_load_blocks + wanted > MAX_PREFIX_LOAD_SHARE * pool.num_blocks:
            return False  # one load is always let through: it holds what its request would need anyway
        if self.tier.is_backing_off:
            self._degrade(seq, Operation.LOAD_PREFIX, Degradation.UNAVAILABLE, "backing off after a failure")
            return False
        block_ids = tuple(pool.allocate(wanted))
        self._num_load_blocks += wanted
        self._loading[seq.request_id] = ColdPrefix(first, block_ids)
        self._held[seq.request_id] = seq
        names = tuple(BlockHash(h.hex()) for h in hashes[first:])
        job = Job(
            Operation.LOAD_PREFIX, seq, seq.cache_salt, seq.trace_metadata, names,
            layout=self._prefix_layout, sink=self.kv_cache.prefix_writer(block_ids),
            deadline_s=time.monotonic() + self.prefix_load_budget_s(seq),
        )  # fmt: skip
        self.tier.submit_after_moves(job)  # the blocks' earlier device work first
        return True

    def prefix_load_budget_s(self, seq: Sequence) -> float:
        """How long `seq` may wait for its stored prefix: the configured cap, and at most
        PREFIX_LOAD_QUEUE_SHARE of its class's queue timeout."""
        cap_s = min(self.config.prefix_load_deadline_ms, self.config.transfer_deadline_ms) / 1000
        if self.classes is None:
            return cap_s
        return min(cap_s, PREFIX_LOAD_QUEUE_SHARE * self.classes.get(seq.intent_class).queue_timeout_s)

    def take_held(self, request_id: RequestId) -> Sequence | None:
        """Stop waiting for a held request's prefix (cancel). Its load's blocks are freed when its
        outcome comes: until then the loader may be writing them."""
        return self._held.pop(request_id, None)

    def held(self) -> list[Sequence]:
        """Requests waiting for their prefix."""
        return list(self._held.values())

    def attach_prefix(self, seq: Sequence, num_hot_blocks: int, max_blocks: int) -> int:
        """Map loaded prompt blocks right after the hot hits; returns how many (changes state). The
        blocks become the table's (a later release frees them, registered, as cached blocks); blocks
        the hot hits already cover are freed."""
        prefix = seq.cold_prefix
        if prefix is None or not prefix.first_block <= num_hot_blocks < prefix.end_block:
            self._let_go(seq)
            return 0
        skip = num_hot_blocks - prefix.first_block
        block_ids = prefix.block_ids[skip : max_blocks - prefix.first_block]
        pool = self.kv_cache.hot.pool
        pool.free([*prefix.block_ids[:skip], *prefix.block_ids[skip + len(block_ids) :]])
        self._num_load_blocks -= len(prefix.block_ids)
        seq.cold_prefix = None
        table = seq.block_table
        table.hot_block_ids.extend(block_ids)
        for offset, block_id in enumerate(block_ids):
            pool.register(block_id, table.prefix_hashes[num_hot_blocks + offset])
        return len(block_ids)

    def on_started(self, seq: Sequence) -> None:
        """A request was admitted: count what its prefix load saved."""
        if seq.num_cold_prompt_tokens:
            self.stats.prompt_tokens_loaded += seq.num_cold_prompt_tokens
            self.stats.prefix_blocks_loaded += seq.num_cold_prompt_tokens // self.kv_cache.block_size
            metrics.COLD_BLOCKS.labels(Operation.LOAD_PREFIX.value).inc(
                seq.num_cold_prompt_tokens // self.kv_cache.block_size
            )
        self._let_go(seq)

    def _let_go(self, seq: Sequence) -> None:
        """The sequence will not map its loaded prefix (any more): free the blocks it still holds."""
        if seq.cold_prefix is not None:
            self.kv_cache.hot.pool.free(seq.cold_prefix.block_ids)
            self._num_load_blocks -= len(seq.cold_prefix.block_ids)
        seq.cold_prefix = None

    def store_prefix(self, seq: Sequence, indexes: list[int]) -> None:
        """Store newly computed prompt blocks that the store does not hold yet."""
        if not self.config.prefix_reuse:
            return
        table = seq.block_table
        for index in indexes:
            name = BlockHash(table.prefix_hashes[index].hex())
            if name not in self._stored_prefix:
                store = ColdStore(Operation.STORE_PREFIX, seq, name, (table.hot_block_ids[index],))
                self.kv_cache.pending_cold.stores.append(store)

    # --- demotion and the auxiliary window -----------------------------------------------------

    def demote(self, seq: Sequence, sources: tuple[ColdSource, ...]) -> None:
        """Store groups that left the warm tier, and keep their summary slots."""
        table = seq.block_table
        for source in sources:
            first = source.first_block
            name = BlockHash(hashlib.sha256(f"{seq.request_id}:{first}".encode()).hexdigest())
            slot = len(table.cold_blocks)
            table.cold_blocks[first] = ColdBlock(name, slot)
            store = ColdStore(
                Operation.DEMOTE, seq, name, source.hot_block_ids, source.warm_group, summary_slot=slot
            )
            self.kv_cache.pending_cold.stores.append(store)

    def rows_to_score(self, seqs: list[Sequence]) -> list[ScoreRow]:
        """Decode rows whose query scores their cold blocks this step.

        Every `score_every_steps` steps, and for a request whose window was never scored, at its
        first decode step with a stored cold block: a short answer must not end before its window
        is chosen.
        """
        self.num_steps += 1
        is_cadence = self.num_steps % self.config.score_every_steps == 0
        rows = [
            ScoreRow(row, seq.request_id, len(seq.block_table.cold_blocks), self._num_ranked(seq))
            for row, seq in enumerate(seqs)
            if seq.uses_aux_window
            and self._window_blocks(seq)
            and (is_cadence or seq.request_id not in self._scored)
            and _has_stored(seq)
        ]
        self._scored.update(row.owner for row in rows)
        return rows

    def _window_blocks(self, seq: Sequence) -> int:
        """Cold blocks (warm groups) the auxiliary window holds."""
        return self.config.aux_window_tokens // max(seq.block_table.tiers.group_size, 1)

    def _num_ranked(self, seq: Sequence) -> int:
        """Blocks a scoring ranks: the window's, then the runner-ups staged in the store's RAM."""
        num_window = self._window_blocks(seq)
        setting = self.config.prefetch_blocks
        return num_window + (num_window if setting == -1 else setting)

    def choose_window(self, seq: Sequence, slots: list[int]) -> None:
        """The blocks a query ranked (best first): the window's share is attended (unmap the others,
        load the missing ones); the runner-ups after it are staged in the kvstore's RAM."""
        table = seq.block_table
        by_slot = {b.slot: (first, b) for first, b in table.cold_blocks.items()}
        num_window = self._window_blocks(seq)
        runner_ups = [by_slot[s] for s in slots[num_window:] if s in by_slot]
        chosen = [by_slot[s] for s in slots[:num_window] if s in by_slot and by_slot[s][1].is_stored]
        if not chosen:  # the query's best blocks are still being stored: score again next step
            self._scored.discard(seq.request_id)
        wanted = {first for first, _ in chosen}
        self._window_wanted[seq.request_id] = wanted
        for first in [f for f in table.aux_blocks if f not in wanted]:
            self._unmap(seq, first)
        missing = [(first, b) for first, b in chosen if first not in table.aux_blocks]
        for first, _ in missing:
            self._window_asked_at[(seq.request_id, first)] = self.num_steps
        if missing:
            names = tuple(BlockHash(b.block_hash) for _, b in missing)
            shape = self._window_shape(seq)
            self.tier.submit(
                Job(Operation.LOAD_WINDOW, seq, seq.cache_salt, seq.trace_metadata, names, window_shape=shape)
            )
        self._prefetch(seq, runner_ups)  # after the window's own load, on the writer thread

    def _window_shape(self, seq: Sequence) -> WindowShape:
        """What each of the sequence's window blocks is: a warm group `[L, G, KVH, D]` as demoted."""
        num_layers, _, _, num_kv_heads, head_dim = self.kv_cache.hot.keys.shape  # [L, N, BS, KVH, D]
        return WindowShape(num_layers, seq.block_table.tiers.group_size, num_kv_heads, head_dim)

    def _prefetch(self, seq: Sequence, runner_ups: list[tuple[int, ColdBlock]]) -> None:
        """Ask the store to stage stored runner-ups (first block, block) not attended and not asked
        for before."""
        asked = self._prefetched.setdefault(seq.request_id, set())
        names = tuple(
            BlockHash(b.block_hash)
            for first, b in runner_ups
            if b.is_stored and b.block_hash not in asked and first not in seq.block_table.aux_blocks
        )
        if not names:
            return
        asked.update(names)
        self.stats.blocks_prefetched += len(names)
        metrics.COLD_BLOCKS.labels(Operation.PREFETCH.value).inc(len(names))
        self.tier.submit(Job(Operation.PREFETCH, seq, seq.cache_salt, seq.trace_metadata, names))

    def _map_window(self, seq: Sequence, loaded: tuple[LoadedBlock, ...]) -> None:
        table = seq.block_table
        wanted = self._window_wanted.get(seq.request_id, set())
        first_of = {b.block_hash: first for first, b in table.cold_blocks.items()}
        blocks_per_group = table.tiers.group_size // self.kv_cache.block_size
        pool = self.kv_cache.hot.pool
        for block in loaded:
            first = first_of.get(block.block_hash)
            asked = self._window_asked_at.pop((seq.request_id, first), None) if first is not None else None
            if first is None or first not in wanted or first in table.aux_blocks:
                continue
            if pool.num_free_blocks() < 2 * blocks_per_group:  # leave room for the batch to grow
                continue
            # a pruned block's kept tokens fill its first pages; the rest of its span stays unmapped
            block_ids = pool.allocate(block.keys.shape[1] // self.kv_cache.block_size)
            for offset, block_id in enumerate(block_ids):
                table.hot_block_ids[first + offset] = block_id
            table.aux_blocks[first] = tuple(block_ids)
            self.kv_cache.pending_cold.loads.append(
                ColdLoad.of_tokens(tuple(block_ids), block.keys, block.values)
            )
            self.stats.window_loads += 1
            self.stats.window_loads_in_time += int(asked is not None and self.num_steps - asked <= 1)
            metrics.COLD_BLOCKS.labels(Operation.LOAD_WINDOW.value).inc()

    def _unmap(self, seq: Sequence, first: int) -> None:
        table = seq.block_table
        block_ids = table.aux_blocks.pop(first)
        self.kv_cache.hot.pool.free(block_ids)
        for offset in range(len(block_ids)):
            table.hot_block_ids[first + offset] = SCRATCH_BLOCK

    def num_window_tokens(self, seq: Sequence) -> int:
        """Cold tokens the sequence attends now (a pruned block counts its kept tokens)."""
        return sum(map(len, seq.block_table.aux_blocks.values())) * self.kv_cache.block_size

    def release(self, seq: Sequence) -> None:
        """A request ended: forget its window and delete its demoted blocks from the store."""
        self._let_go(seq)  # ended before it started: its loaded prefix is not mapped
        self._window_wanted.pop(seq.request_id, None)
        self._prefetched.pop(seq.request_id, None)
        self._scored.discard(seq.request_id)
        self.summaries.forget(seq.request_id)
        for key in [k for k in self._window_asked_at if k[0] == seq.request_id]:
            del self._window_asked_at[key]
        names = tuple(BlockHash(b.block_hash) for b in seq.block_table.cold_blocks.values())
        if names:
            self.tier.submit(Job(Operation.DELETE, seq, seq.cache_salt, seq.trace_metadata, names))

    # --- outcomes ------------------------------------------------------------------------------

    def take_ready(self) -> list[Sequence]:
        """Apply what the kvstore threads reported; returns held requests whose prefix load ended."""
        ready: list[Sequence] = []
        for outcome in self.tier.take_outcomes():
            seq = outcome.owner
            assert isinstance(seq, Sequence)
            if outcome.operation is Operation.LOAD_PREFIX:
                self._prefix_outcome(seq, outcome, ready)
                continue
            if outcome.degraded is not None and outcome.operation is not Operation.PREFETCH:
                # a failed prefetch leaves the request's attention as it was (not a degradation);
                # like any failed call, it starts the loads' backoff
                self._degrade(seq, outcome.operation, outcome.degraded, outcome.detail)
            if outcome.operation is Operation.STORE_PREFIX:
                self._prefix_stored(outcome)
            elif outcome.operation is Operation.DEMOTE:
                self._demoted(seq, outcome)
            elif outcome.operation is Operation.LOAD_WINDOW and not seq.is_finished and outcome.loaded:
                self._map_window(seq, outcome.loaded)
        return ready

    def _prefix_outcome(self, seq: Sequence, outcome: Outcome, ready: list[Sequence]) -> None:
        """A prefix load ended, or its deadline passed first (`gave_up`): then the request stops
        waiting and computes its prompt, and the load's blocks stay its own until it ends. A
        degradation counts once, for a request still waiting (not a cancelled or released one)."""
        is_waiting = seq.request_id in self._held
        if outcome.degraded is not None and is_waiting:
            self._degrade(seq, outcome.operation, outcome.degraded, outcome.detail)
        if not outcome.gave_up:
            self._prefix_loaded(seq, outcome, ready)
        elif is_waiting:
            del self._held[seq.request_id]
            ready.append(seq)

    def _prefix_loaded(self, seq: Sequence, outcome: Outcome, ready: list[Sequence]) -> None:
        """The loader is done with the load's blocks: the written run waits for the request's
        admission; the rest (all of it when the request was cancelled meanwhile) goes back."""
        load = self._loading.pop(seq.request_id, None)
        if load is None:  # not a load of ours (never expected): nothing to free, nobody waits
            logger.error("a prefix load's outcome for %s, which started no load", seq.request_id)
            return
        num_blocks = outcome.prefix_blocks if seq.request_id in self._held else 0
        self.kv_cache.hot.pool.free(load.block_ids[num_blocks:])
        self._num_load_blocks -= len(load.block_ids) - num_blocks
        if self._held.pop(seq.request_id, None) is None:
            return  # cancelled while its prefix was loading
        if num_blocks:
            seq.cold_prefix = ColdPrefix(load.first_block, load.block_ids[:num_blocks])
            self.stats.prefix_blocks_read_locally += outcome.num_read_locally
        ready.append(seq)

    def _prefix_stored(self, outcome: Outcome) -> None:
        for name in outcome.stored:
            self._stored_prefix[name] = None
            self._stored_prefix.move_to_end(name)
        while len(self._stored_prefix) > MAX_REMEMBERED_PREFIX_BLOCKS:
            self._stored_prefix.popitem(last=False)
        self.stats.prefix_blocks_stored += len(outcome.stored)
        metrics.COLD_BLOCKS.labels(Operation.STORE_PREFIX.value).inc(len(outcome.stored))

    def _demoted(self, seq: Sequence, outcome: Outcome) -> None:
        stored = set(outcome.stored)
        for block in seq.block_table.cold_blocks.values():
            if block.block_hash in stored:
                block.is_stored = True
        self.stats.blocks_demoted += len(stored)
        metrics.COLD_BLOCKS.labels(Operation.DEMOTE.value).inc(len(stored))

    def _degrade(self, seq: Sequence, operation: Operation, reason: Degradation, detail: str) -> None:
        """A kvstore call gave nothing: count it, and put it on the request's trace."""
        self.stats.degradations += 1
        metrics.COLD_DEGRADATIONS.labels(operation.value, reason.value).inc()
        seq.add_event(
            "thermocline.kv.cold_degraded",
            {
                "thermocline.kv.operation": operation.value,
                "thermocline.kv.reason": reason.value,
                "thermocline.kv.detail": detail,
                "thermocline.kv.fallback": "hot+warm",
            },
        )


def _has_stored(seq: Sequence) -> bool:
    return any(block.is_stored for block in seq.block_table.cold_blocks.values())
