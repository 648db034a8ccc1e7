"""Shared fixtures for engine tests: tiny random Llamas, SmolLM2 (stories260K's are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.llm_engine import LLMEngine
from services.engine.model.registry import DEFAULT_MODEL, resolve_model
from tests.engine.tiny_llama import TinySpec, make_tiny_llama


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_model: runs a real downloaded model (SmolLM2-135M, ~100 MB, CPU); slow but on by default",
    )


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
