""".dockerignore against what the image must hold: every file the services load, and no key.

The image is built with `COPY . .` and runs `python -m services.<name>` from that tree, so a file
that .dockerignore drops from services/ is missing at run time (the safety gate's weights were,
through a `**/*.safetensors` rule meant for model downloads). No Docker engine is needed: the rules
are read with Docker's matching (patterns relative to the context root, `*` and `?` within one path
part, `**` across parts, a matched folder excludes what is under it, the last matching rule wins,
`!` re-includes).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
IMAGE_TREES = ("services", "protos")  # what `python -m services.<name>` and `pip install .` read
IMAGE_FILES = ("pyproject.toml",)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    # A pattern that names a folder also excludes everything under it.
    return re.compile("".join(parts) + "(?:/.*)?")


def _rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line[1:] if keep else line
        pattern = pattern.strip().strip("/")
        rules.append((keep, _pattern_regex(pattern)))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves `path` (relative to the context, with `/`) out of the build context."""
    out = False
    for keep, regex in rules:
        if regex.fullmatch(path):
            out = not keep
    return out


def _read_rules() -> list[tuple[bool, re.Pattern[str]]]:
    return _rules((REPO_ROOT / ".dockerignore").read_text())


def test_the_matcher_reads_dockerignore_rules_as_docker_does() -> None:
    rules = _rules("**/*.gguf\nvar/\n**/*.pem\n!keep/*.pem\n")
    assert excluded("model.gguf", rules)
    assert excluded("a/b/model.gguf", rules)
    assert excluded("var/audit/log", rules)
    assert not excluded("services/var.py", rules)
    assert excluded("deploy/k.pem", rules)
    assert not excluded("keep/k.pem", rules)
    assert not excluded("model.gguf.txt", rules)


def test_every_file_the_services_load_is_in_the_build_context() -> None:
    rules = _read_rules()
    wanted = [REPO_ROOT / name for name in IMAGE_FILES]
    for tree in IMAGE_TREES:
        wanted += [
            path
            for path in (REPO_ROOT / tree).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        ]
    assert any(path.name.endswith(".safetensors") for path in wanted), "no safety gate weights found"
    relative = [path.relative_to(REPO_ROOT).as_posix() for path in wanted]
    missing = [path for path in relative if excluded(path, rules)]
    assert not missing, f".dockerignore leaves files the services need out of the image: {missing}"


def test_signing_keys_and_local_state_stay_out_of_the_image() -> None:
    rules = _read_rules()
    kept_out = (
        "deploy/keys/jwt-private.pem",
        "deploy/keys/audit.key",
        "var/audit/decisions.log",
        ".venv/bin/python",
        ".git/HEAD",
    )
    for path in kept_out:
        assert excluded(path, rules), path
