"""Services share contracts (protos) and services/common, never each other's packages.

A static check over the source: every import statement in services/<name>/ is parsed with `ast`,
so an import inside a function (the way the gateway once reached into the engine's tokenizer)
counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICES_DIR = Path(__file__).resolve().parents[1] / "services"
SERVICES = ("engine", "gateway", "kvstore", "safety")
SHARED = "common"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in one file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend([(node.lineno, node.module)])
            if node.module == "services":  # `from services import engine`
                found.extend((node.lineno, f"services.{alias.name}") for alias in node.names)
    return found


def foreign_imports(package: str) -> list[str]:
    """`file:line: module` for each import from `package` of a package it may not use.

    A service may import itself and services/common; services/common may import no service.
    """
    allowed = {package, SHARED}
    found = []
    for path in sorted((SERVICES_DIR / package).rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] not in allowed:
                found.append(f"{path.relative_to(SERVICES_DIR.parent)}:{line}: {module}")
    return found


@pytest.mark.parametrize("package", [*SERVICES, SHARED])
def test_no_service_imports_another(package: str) -> None:
    """services/common may import no service at all; a service only itself and common."""
    found = foreign_imports(package)
    assert not found, (
        f"services/{package} imports another service's package; call it over its gRPC contract "
        "(protos/) or move shared code to services/common:\n" + "\n".join(found)
    )


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The check is not blind to the import that started it: one nested in a function body."""
    source = tmp_path / "budget.py"
    source.write_text("def load():\n    from services.engine.text.tokenizer import Tokenizer\n")
    assert (2, "services.engine.text.tokenizer") in imported_modules(source)


def test_every_service_folder_is_checked() -> None:
    """A new service folder must be added to SERVICES (or is the CLI, which starts them all)."""
    folders = {p.name for p in SERVICES_DIR.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"cli"} == {*SERVICES, SHARED}
