"""One engine process on loopback, alone: no kvstore, no safety service, no in-loop gate."""

from __future__ import annotations

from pathlib import Path

from services.cli.mesh import Mesh, MeshConfig, Ports

ALONE = {
    "THERMOCLINE_ENGINE_KVSTORE_TARGET": "",  # no cold tier
    "THERMOCLINE_ENGINE_SAFETY_TARGET": "",
    "THERMOCLINE_ENGINE_GATE_SOURCE": "off",
    "THERMOCLINE_ENGINE_DEVICE": "cpu",
    "THERMOCLINE_ENGINE_WARM_UP": "false",
}


def start_engine(model: Path, state_dir: Path, **env: str) -> Mesh:
    """A started engine process serving `model` (`mesh.target("engine")`); `env` adds settings."""
    mesh = Mesh(MeshConfig(model=str(model), state_dir=state_dir, ports=Ports.free(), env=ALONE | env))
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        mesh.start_service("engine")
    except BaseException:
        mesh.stop()
        raise
    return mesh
