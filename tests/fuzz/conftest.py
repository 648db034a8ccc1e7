"""The fuzz suite's mesh and Hypothesis settings.

CI runs a fixed, derandomized set of examples (THERMOCLINE_FUZZ_EXAMPLES per test, default 20);
bench/fuzz.py runs the same tests with more examples and a random seed
(THERMOCLINE_FUZZ_RANDOM=1) and reports how many calls each RPC got.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, Phase, settings

from services.cli.mesh import SERVICES, Mesh
from services.gateway.tokens import mint_token
from tests.fuzz.rpcs import CALLS

settings.register_profile(
    "thermocline-fuzz",
    max_examples=int(os.environ.get("THERMOCLINE_FUZZ_EXAMPLES", "20")),
    deadline=None,  # a call's time depends on the machine; a hang is caught by the call's own timeout
    derandomize=os.environ.get("THERMOCLINE_FUZZ_RANDOM") != "1",
    database=None,  # a failure prints its reproducing blob; nothing is written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
    # No shrinking: each shrink step is a real call through the mesh, and a failing example (or an
    # expected failure) would spend minutes of CI on it. The failing example and its blob are printed.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
FUZZ_SETTINGS = settings.get_profile("thermocline-fuzz")


@pytest.fixture(scope="session")
def fuzz_mesh(open_mesh: Mesh) -> Mesh:
    """The open mesh (tests/conftest.py): no tenant limits, so no call is refused before validation."""
    return open_mesh


@pytest.fixture(scope="session")
def fuzz_channels(fuzz_mesh: Mesh) -> Iterator[dict[str, grpc.Channel]]:
    """One channel per service of the fuzz mesh."""
    channels = {name: fuzz_mesh.channel(name) for name in SERVICES}
    yield channels
    for channel in channels.values():
        channel.close()


@pytest.fixture(scope="session")
def fuzz_token(fuzz_mesh: Mesh) -> str:
    """A valid token, so that gateway requests get past authentication to validation."""
    return mint_token(fuzz_mesh.private_key_path.read_bytes(), subject="fuzzer", tenant="fuzz")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Writes the call counts where bench/fuzz.py asked for them."""
    if path := os.environ.get("THERMOCLINE_FUZZ_COUNTS"):
        counts = [{"rpc": rpc, "status": status, "calls": n} for (rpc, status), n in sorted(CALLS.items())]
        Path(path).write_text(json.dumps(counts, indent=1))
