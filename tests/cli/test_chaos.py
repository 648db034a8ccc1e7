"""Chaos in CI: bench/chaos.py's cycles, one per process (gateway, engine, Redis, kvstore, safety, each
SIGKILLed under load and restarted). No request the client saw acknowledged may lose its audit
event, the audit log must verify, no block the kvstore acknowledged may be lost, no block it serves
may differ from what was written, and after every kill a request must succeed again.
bench/chaos.py runs more."""

from __future__ import annotations

from pathlib import Path

from bench.chaos import VICTIMS, chaos


def test_sigkill_cycles_under_load_lose_no_acknowledged_audit_event(
    stories_model: Path, tmp_path: Path
) -> None:
    result = chaos(tmp_path / "chaos", num_cycles=len(VICTIMS), num_clients=1)
    assert [c.victim for c in result.cycles] == list(VICTIMS)  # each recovered: a request succeeded after it
    assert len(result.acknowledged) > 0, "the load never completed a request, so nothing was checked"
    assert not result.lost, f"acknowledged requests with no audit event: {sorted(result.lost)[:10]}"
    assert result.verify_status == 0, result.verify_line
    blocks = result.blocks
    assert blocks.acknowledged, "the kvstore never acknowledged a block, so nothing was checked"
    assert not blocks.lost, f"acknowledged blocks not served with their bytes: {sorted(blocks.lost)[:10]}"
    assert not blocks.torn, f"blocks served with bytes other than those written: {sorted(blocks.torn)[:10]}"
