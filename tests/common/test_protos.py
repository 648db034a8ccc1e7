"""The generated stubs in protos/ must be exactly what tools/gen_protos.py makes from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_files(root: Path) -> dict[str, bytes]:
    suffixes = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in root.rglob("*")
        if path.name.endswith(suffixes)
    }


def test_stubs_are_fresh(tmp_path: Path) -> None:
    _generator().generate(tmp_path)
    fresh = _generated_files(tmp_path)
    committed = _generated_files(ROOT / "protos")
    assert fresh, "the generator produced nothing"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"stale generated stubs {stale}; run: python tools/gen_protos.py"


def test_every_rpc_and_field_is_commented() -> None:
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_rpc = stripped.startswith("rpc ")
            is_field = (
                stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option"))
            )
            if is_rpc or is_field:
                previous = lines[number - 1].strip()
                assert previous.startswith("//"), f"{proto.name}:{number + 1} has no comment: {stripped}"
