"""Regenerate the Python stubs and .pyi files from protos/ (run: python tools/gen_protos.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    """Every .proto under protos/, in a stable order."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir."""
    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    for package_dir in {p.parent for p in out_dir.rglob("*_pb2.py")}:
        for parent in [package_dir, *package_dir.parents]:
            if parent == out_dir:
                break
            (parent / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
