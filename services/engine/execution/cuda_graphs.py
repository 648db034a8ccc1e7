"""CUDA graphs for decode: one captured forward (and LM head) per batch size, replayed with new metadata.

A decode step of B rows replays the graph of the smallest captured size >= B, padding the rest with
empty rows (no context; their K/V go to the scratch slot). Prefill, and decode steps that score cold
blocks, stay eager. The graphs share one memory pool, captured largest first.

With a warm tier, every replay also leaves the probe layer's queries in a static buffer (one small
copy per step), so a step that samples the attention probe replays too and the probe reads them
afterwards (`ModelRunner`): an eager 8B step costs several times a replayed one.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import HostMetadata, QueryTap, StaticMetadata
from services.engine.attention.probe import AttentionProbe
from services.engine.kv.cache import KVCache
from services.engine.model.llama import LlamaModel

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GraphOutput(NamedTuple):
    """Static output buffers of one captured size."""

    hidden: torch.Tensor  # [size, E]
    logits: torch.Tensor | None  # [size, V] fp32 (None on ranks that do not sample)


class DecodeGraphs:
    """Captured decode steps for every size in CAPTURE_SIZES up to `max_rows`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        attention: AttentionBackend,
        max_rows: int,
        max_seq_len: int,
        compute_logits: bool,
        probe_layer: int | None = None,
    ) -> None:
        """`probe_layer`: the layer whose queries each replay keeps for the attention probe (None: none)."""
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.max_seq_len = max_seq_len
        self.compute_logits = compute_logits
        device = kv_cache.hot.keys.device
        max_blocks = -(-max_seq_len // kv_cache.block_size)
        self.sizes = sorted({s for s in CAPTURE_SIZES if s < max_rows} | {max_rows})
        self.static = StaticMetadata(self.sizes[-1], max_blocks, kv_cache.block_size, device)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self._staging_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=True)
        self._staged: torch.cuda.Event | None = None  # recorded after each copy out of _staging_ids
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutput]] = {}
        self.probe_layer = probe_layer
        config = model.rank_config
        self.probe_queries = (  # [max_rows, H, D] fp32: the probe layer's queries of the last replay
            None
            if probe_layer is None
            else torch.zeros(self.sizes[-1], config.num_heads, config.head_dim, device=device)
        )
        self.num_replays = 0  # decode steps served by a graph (tests and stats read it)

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        pool = None
        for size in reversed(self.sizes):
            metadata = self.static.view(size, self.attention.num_segments(size, self.max_seq_len))
            if self.probe_queries is not None:
                tap = QueryTap(self.probe_layer, self.probe_queries[:size])  # type: ignore[arg-type]
                metadata = dataclasses.replace(metadata, query_tap=tap)
            self._run(size, metadata)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self._run(size, metadata)
            pool = graph.pool()
            self.graphs[size] = (graph, output)
        if self.probe_queries is not None:  # the probe's first run loads its kernels (~150 ms on an
            # H200): at load, not in the first sampled step of some request (on an empty row here)
            probe = AttentionProbe.build(self.probe_layer, self.input_ids.device)  # type: ignore[arg-type]
            probe.record(self.kv_cache, self.probe_queries[:1], self.static.view(1, 1))
        torch.cuda.synchronize()

    def can_replay(self, host: HostMetadata) -> bool:
        """A decode step that fits the largest captured size and the captured table width."""
        return (
            bool(self.graphs)
            and host.is_decode
            and host.num_rows <= self.sizes[-1]
            and host.block_tables.shape[1] <= self.static.max_blocks
        )

    def replay(self, token_ids: list[int] | torch.Tensor, host: HostMetadata) -> GraphOutput:
        """Run the captured step for `host`'s rows; outputs are views of the graph's static buffers.

        `token_ids` come from the host, or (an overlapped step) are the last step's sampled ids still
        on the device, copied in stream order."""
        num_rows = host.num_rows
        size = next(s for s in self.sizes if s >= num_rows)
        graph, output = self.graphs[size]
        self.static.fill(host, size)
        if isinstance(token_ids, torch.Tensor):
            self.input_ids[:num_rows].copy_(token_ids)
        else:
            if self._staged is not None:  # the last host-id copy out of the staging buffer has run
                self._staged.synchronize()
            self._staging_ids[:num_rows] = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
            self.input_ids[:num_rows].copy_(self._staging_ids[:num_rows], non_blocking=True)
            self._staged = torch.cuda.Event()
            self._staged.record()
        graph.replay()
        self.num_replays += 1
        logits = None if output.logits is None else output.logits[:num_rows]
        return GraphOutput(output.hidden[:num_rows], logits)

    def _run(self, size: int, metadata) -> GraphOutput:
        hidden = self.model(self.input_ids[:size], self.kv_cache, self.attention, metadata)  # [size, E]
        logits = self.model.compute_logits(hidden) if self.compute_logits else None
        return GraphOutput(hidden, logits)
