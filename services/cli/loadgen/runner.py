"""Drives one load level: open loop (requests at planned arrival times, whatever the server's pace)
or closed loop (a fixed number of clients, each sending its next request when the last one ends)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from services.cli.loadgen.gateway_client import GatewayLoadClient
from services.cli.loadgen.record import RequestRecord
from services.cli.loadgen.schedule import open_loop_plan, rescale_trace
from services.cli.loadgen.workload import PlannedRequest, Workload

OPEN, CLOSED = "open", "closed"


@dataclass(frozen=True)
class LevelSpec:
    """One load level. `load` is requests/s (open loop) or concurrent clients (closed loop).

    A level ends after `num_requests` sends or, when that is None, stops sending at `duration_s`;
    either way it waits for every request in flight, so every send is counted.
    """

    mode: str
    load: float
    num_requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in (OPEN, CLOSED):
            raise ValueError(f"mode must be '{OPEN}' or '{CLOSED}', got {self.mode!r}")
        if self.load <= 0 or (self.mode == CLOSED and self.load != int(self.load)):
            raise ValueError(
                f"{self.mode}-loop load must be a positive {'integer' if self.mode == CLOSED else 'number'}"
            )
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("a level needs exactly one of num_requests and duration_s")


@dataclass(frozen=True)
class LevelRun:
    """The records of one level and how long it took, first send to last reply."""

    spec: LevelSpec
    records: list[RequestRecord]
    wall_s: float


class RequestSource:
    """The requests of a level: drawn from the workload, or taken from a trace in order."""

    def __init__(
        self,
        spec: LevelSpec,
        workload: Workload | None,
        trace: Sequence[PlannedRequest] | None,
        seed: int = 0,
    ) -> None:
        if (workload is None) == (trace is None):
            raise ValueError("a run needs exactly one of a workload and a trace")
        self.spec, self.workload = spec, workload
        # Seeded alike at every level of a run: each level sends the same requests (see open_loop_plan).
        self.arrival_rng = random.Random(f"{seed}:arrivals")
        self.request_rng = random.Random(f"{seed}:requests")
        self.trace = list(trace) if trace is not None else None

    def open_loop_plan(self) -> list[PlannedRequest]:
        """Every request of an open-loop level with its arrival time."""
        spec = self.spec
        if self.workload is not None:
            return open_loop_plan(
                self.workload,
                spec.load,
                self.arrival_rng,
                self.request_rng,
                num_requests=spec.num_requests,
                duration_s=spec.duration_s,
            )
        assert self.trace is not None
        plan = rescale_trace(self.trace, spec.load)
        if spec.num_requests is not None:
            return plan[: spec.num_requests]
        return [r for r in plan if (r.offset_s or 0.0) < (spec.duration_s or 0.0)]

    def closed_loop_pull(self, deadline_s: float) -> Callable[[], PlannedRequest | None]:
        """A function that hands out the next request, or None once the level is over."""
        num_handed = 0
        spec = self.spec

        def pull() -> PlannedRequest | None:
            nonlocal num_handed
            if spec.num_requests is not None and num_handed >= spec.num_requests:
                return None
            if spec.duration_s is not None and time.monotonic() >= deadline_s:
                return None
            if self.trace is not None:
                if num_handed >= len(self.trace):
                    return None
                planned = self.trace[num_handed]
            else:
                assert self.workload is not None
                planned = self.workload.draw(self.request_rng)
            num_handed += 1
            return planned

        return pull


async def run_level(client: GatewayLoadClient, source: RequestSource, show_progress: bool = True) -> LevelRun:
    """Runs one level to completion."""
    spec = source.spec
    label = f"{spec.mode} loop, {spec.load:g} {'req/s' if spec.mode == OPEN else 'clients'}"
    if spec.mode == OPEN:
        plan = source.open_loop_plan()
        with tqdm(total=len(plan), desc=label, unit="req", disable=not show_progress) as bar:
            records, wall_s = await _open_loop(client, plan, bar)
    else:
        with tqdm(total=spec.num_requests, desc=label, unit="req", disable=not show_progress) as bar:
            records, wall_s = await _closed_loop(client, source, int(spec.load), bar)
    return LevelRun(spec, records, wall_s)


async def _open_loop(
    client: GatewayLoadClient, plan: Sequence[PlannedRequest], bar: tqdm
) -> tuple[list[RequestRecord], float]:
    start_s = time.monotonic()

    async def send(planned: PlannedRequest) -> RequestRecord:
        record = await client.send(planned, start_s)
        bar.update()
        return record

    tasks = []
    for planned in plan:
        # The wait is the arrival process itself: open loop sends on schedule, not on replies.
        if (delay_s := start_s + (planned.offset_s or 0.0) - time.monotonic()) > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(send(planned)))
    records = list(await asyncio.gather(*tasks))
    return records, time.monotonic() - start_s


async def _closed_loop(
    client: GatewayLoadClient, source: RequestSource, concurrency: int, bar: tqdm
) -> tuple[list[RequestRecord], float]:
    start_s = time.monotonic()
    pull = source.closed_loop_pull(start_s + (source.spec.duration_s or 0.0))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while (planned := pull()) is not None:
            records.append(await client.send(planned, start_s))
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.monotonic() - start_s


async def warm_up(client: GatewayLoadClient, requests: Sequence[PlannedRequest]) -> list[RequestRecord]:
    """Sends `requests` one after another before any level (first-call costs); not counted in the report."""
    return [await client.send(planned, time.monotonic()) for planned in requests]
