"""A process of the mesh that cannot bind one of its ports fails with a message that says what holds
the port, so that a port taken between the pick and the bind is explained, not guessed at."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports, ServiceFailed
from services.common.ports import free_port, port_holders


def test_port_holders_names_the_listener_and_its_process() -> None:
    port = free_port()
    assert port_holders(port) == []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        (held,) = port_holders(port)
    assert held.startswith(f"LISTEN (pid {os.getpid()}: ")


def test_a_service_whose_metrics_port_is_taken_fails_naming_the_holder(
    stories_model: Path, tmp_path: Path
) -> None:
    ports = Ports.free()
    config = MeshConfig(model=str(stories_model), state_dir=tmp_path, ports=ports, startup_timeout_s=120)
    with socket.socket() as squatter:  # the kvstore starts first after Redis
        squatter.bind(("127.0.0.1", ports.metrics["kvstore"]))
        squatter.listen()
        with pytest.raises(ServiceFailed) as failed, Mesh(config):
            pass
    message = str(failed.value)
    assert message.startswith("kvstore exited")
    assert "Address already in use" in message
    assert f"kvstore metrics {ports.metrics['kvstore']}: LISTEN (pid {os.getpid()}: " in message
