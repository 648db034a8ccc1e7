"""Tensor-parallel ranks 1..N-1: child processes that follow rank 0's steps in lockstep.

Rank 0 is the engine process itself: it schedules, samples and streams. Each other rank loads its
shard of the same checkpoint, builds a KV cache of the same shape over its share of the KV heads,
then runs every `StepPlan` rank 0 sends it. The plans travel over a pipe per rank, so an idle engine
holds no collective open (a gloo or NCCL timeout never fires while nobody asks for tokens), and a
rank whose parent dies sees the pipe close and exits. The activations travel over
`torch.distributed`: gloo on the CPU, NCCL on GPUs (rank r on `cuda:r`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from services.common.ports import free_port
from services.engine.execution.model_runner import ModelRunner, RunnerOptions, StepPlan
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.model.config import ModelConfig
from services.engine.model.loader import load_model, open_checkpoint
from services.engine.model.tensor_parallel import TensorParallel, TensorParallelError, check_divisible

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120  # every rank must join the process group within this (before model loading)
READY_TIMEOUT_S = 600  # every rank must have loaded its shard and built its cache within this
READY = "ready"
CAPTURE_GRAPHS = "capture-graphs"  # rank 0 -> followers: capture decode graphs now, alongside me


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to load its shard: sent to each child at spawn."""

    model_path: str
    device_type: str  # "cpu" or "cuda"
    dtype: torch.dtype
    max_positions: int
    world_size: int
    init_method: str  # tcp://127.0.0.1:<port>

    @property
    def backend(self) -> str:
        """NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        """Rank r runs on `cuda:r`, or on the CPU."""
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class CacheShape:
    """The KV cache rank 0 built, which every rank builds too (over its own KV heads)."""

    num_hot_blocks: int
    block_size: int
    num_warm_groups: int  # 0: no warm tier
    group_size: int

    @classmethod
    def of(cls, cache: KVCache) -> CacheShape:
        """The shape of rank 0's cache."""
        warm = cache.warm
        return cls(
            cache.hot.keys.shape[1],  # every block, scratch included (the pool counts only usable ones)
            cache.block_size,
            warm.num_groups if warm else 0,
            warm.group_size if warm else 0,
        )

    def build(self, rank_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> KVCache:
        """An empty cache of this shape for one rank's heads."""
        hot = HotTier(rank_config, self.num_hot_blocks, self.block_size, device, dtype)
        warm = (
            WarmTier(rank_config, self.num_warm_groups, self.group_size, device)
            if self.num_warm_groups
            else None
        )
        return KVCache(hot, warm)


class RankLost(TensorParallelError):
    """A tensor-parallel rank exited: the group cannot run another step until the engine restarts."""


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: launch, hand them the cache shape, send steps, stop."""

    def __init__(self, spec: WorkerSpec, processes: list[BaseProcess], pipes: list[Connection]) -> None:
        self.spec = spec
        self.processes = processes
        self.pipes = pipes
        self.tp = TensorParallel(rank=0, size=spec.world_size)

    @classmethod
    def launch(
        cls,
        model_path: str,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        tp: int,
    ) -> WorkerGroup:
        """Spawn ranks 1..tp-1 and join the process group as rank 0 (returns once all ranks joined)."""
        check_divisible(config, tp)
        _check_devices(device, tp)
        spec = WorkerSpec(model_path, device.type, dtype, max_positions, tp, f"tcp://127.0.0.1:{free_port()}")
        context = mp.get_context("spawn")  # CUDA cannot be forked; spawn on the CPU too, one code path
        processes: list[BaseProcess] = []
        pipes: list[Connection] = []
        for rank in range(1, tp):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=worker_main, args=(rank, spec, child_end), name=f"engine-tp-rank{rank}", daemon=True
            )
            process.start()
            child_end.close()
            processes.append(process)
            pipes.append(parent_end)
        if device.type == "cuda":
            torch.cuda.set_device(spec.device(0))
        _share_host_threads(tp)
        _init_process_group(spec, rank=0)
        return cls(spec, processes, pipes)

    def start(self, shape: CacheShape, options: RunnerOptions) -> None:
        """Give every rank the cache shape and runner options; wait until each has loaded and built."""
        for pipe in self.pipes:
            pipe.send((shape, options))
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(READY_TIMEOUT_S):
                self.close()
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} did not load within {READY_TIMEOUT_S} s"
                )
            answer = pipe.recv()
            if answer != READY:
                self.close()
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {answer}")

    def capture_graphs(self) -> None:
        """Tell every other rank to capture its decode graphs (rank 0 captures right after)."""
        self._check_alive()
        for pipe in self.pipes:
            pipe.send(CAPTURE_GRAPHS)

    def send(self, plan: StepPlan) -> None:
        """Hand one step to every other rank; refused (rather than hang in a collective) if one exited."""
        self._check_alive()
        for pipe in self.pipes:
            pipe.send(plan)

    def lost_rank(self) -> str | None:
        """Why the group cannot run a step (a rank has exited), or None while every rank is alive."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return (
                    f"tensor-parallel rank {rank} exited (exit code {process.exitcode}); this engine "
                    "cannot run steps until it is restarted"
                )
        return None

    def _check_alive(self) -> None:
        if (reason := self.lost_rank()) is not None:
            raise RankLost(reason)

    def close(self) -> None:
        """Stop every other rank and leave the process group."""
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):  # that rank may be gone already
                pipe.send(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
        self.pipes, self.processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(rank: int, spec: WorkerSpec, pipe: Connection) -> None:
    """Entry point of rank `rank`: load, report ready, then follow rank 0's steps until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    try:
        runner = _load_rank(rank, spec, pipe)
    except Exception as exc:  # tell rank 0 why, instead of leaving it waiting
        logger.exception("rank %d failed to start", rank)
        pipe.send(f"{type(exc).__name__}: {exc}")
        return
    pipe.send(READY)
    while True:
        try:
            plan = pipe.recv()
        except EOFError:  # rank 0 is gone
            break
        if plan is None:
            break
        if plan == CAPTURE_GRAPHS:
            runner.capture_graphs()
            continue
        runner.follow(plan)
    dist.destroy_process_group()


def _load_rank(rank: int, spec: WorkerSpec, pipe: Connection) -> ModelRunner:
    device = spec.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _share_host_threads(spec.world_size)
    _init_process_group(spec, rank)
    tp = TensorParallel(rank=rank, size=spec.world_size)
    model = load_model(open_checkpoint(spec.model_path), device, spec.dtype, spec.max_positions, False, tp)
    shape, options = pipe.recv()
    return ModelRunner(model, shape.build(model.rank_config, device, spec.dtype), device, options=options)


def _share_host_threads(world_size: int) -> None:
    """Give each rank its share of the host's cores for host-side tensor work (step inputs on GPUs,
    everything on the CPU): N processes each spinning a thread per core slow one another down."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _init_process_group(spec: WorkerSpec, rank: int) -> None:
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
    )


def _check_devices(device: torch.device, tp: int) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise TensorParallelError(f"tp={tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    if device.type not in ("cpu", "cuda"):
        raise TensorParallelError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {device.type}")
