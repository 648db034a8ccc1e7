"""The engine's settings, read from `THERMOCLINE_ENGINE_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypeVar

from services.common import env
from services.common.config import ServerConfig
from services.engine.gate.gate_loader import DEFAULT_GATE_FILE, GateConfig, GateSource, MismatchPolicy
from services.engine.kv.cold_tier import ColdTierConfig, RetrievalMode
from services.engine.kv.tiers import KVCacheSpec, TierConfig, WarmFullPolicy
from services.engine.scheduling.intent_class import IntentClasses

_Choice = TypeVar("_Choice", bound=Enum)

DEFAULT_PORT = 50052
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineConfig:
    """Which model the engine serves, where, and how many requests it decodes at once.

    `THERMOCLINE_ENGINE_MODEL`: a known model name (see services/engine/model/registry.py), a Hugging Face
    checkpoint directory or a .gguf file. `_DEVICE` (auto, cpu, cuda, cuda:N), `_DTYPE` (auto,
    float32, bfloat16, float16), `_MAX_BATCH_SIZE`, `_MAX_SEQ_LEN` (0 = the model's own limit),
    `_DEFAULT_MAX_TOKENS` (used when a request gives none) and `_MAX_TOKENS_LIMIT` (the cap).
    KV cache: `_GPU_MEMORY_UTILIZATION` (CUDA: the share of device memory for weights, activations
    and KV pools together, default 0.90; the pools get what a profiling step leaves),
    `_CPU_KV_CACHE_MB` (CPU: the pools' budget, default 512), `_KV_BLOCK_SIZE`, `_KV_HOT_BLOCKS`
    (0 = sized from the budget),
    `_KV_TIERS` (off: every token hot), `_KV_SINK_TOKENS`, `_KV_HOT_TOKENS`, `_KV_WARM_TOKENS`,
    `_KV_GROUP_SIZE`, `_KV_WARM_POLICY` (window or refuse), `_KV_WARM_GROUPS` (0 = derived),
    `_KV_MAX_HOT_TOKENS` (0: hot never grows), `_KV_GROW_BELOW_HOT_MASS` (0.5) and
    `_KV_RESTART_HOT_AT_TURNS` (off): the attention-driven tier boundaries.
    In-loop safety gate: `_GATE_SOURCE` (file, safety or off), `_GATE_FILE` (the gate's
    .safetensors, its .json manifest beside it), `_SAFETY_TARGET` (host:port of the safety service
    whose GetGate announces the gate's sha256; unset: not checked), `_GATE_MISMATCH` (refuse or
    warn), `_SAFE_MESSAGE` (what a gated sequence ends with), `_SAFETY_TIMEOUT_S` (how long start-up
    and each re-check wait for safety) and `_GATE_RECHECK_S` (seconds between re-checks of safety's
    announcement while serving, default 30; 0: checked at start-up only).
    Scheduling: `_MAX_PREFILL_TOKENS` (prompt tokens per step; with mixed steps each running
    stream's decode row comes on top, and the memory plan profiles that step), `_MIXED_STEPS`
    (default on: running streams decode a token in every step, prompt chunks beside them; off:
    prompts are computed first and decoding waits for them), `_WARM_UP` (default on: at start-up,
    three made-up requests compile the fused prefill kernels on CUDA) and `_INTENT_CLASSES` (a TOML
    file; empty = the built-in classes). `_MAX_QUEUED_COUNTS`: CountTokens calls waiting for their
    tokenizing pool or on it (default 64); past it a count is refused with RESOURCE_EXHAUSTED.
    `_TP`: tensor-parallel ranks; the engine starts ranks 1..N-1 itself (gloo on the CPU, NCCL with
    one GPU per rank; N must divide the KV heads).
    Cold tier (docs/kvstore.md): `_KVSTORE_TARGET` (host:port of the kvstore; empty: no cold tier),
    `_KVSTORE_DEADLINE_MS` (lookups, deletes, window gets; default 1000),
    `_KVSTORE_TRANSFER_DEADLINE_MS` (every put, and at most a prefix load; default 30000),
    `_KVSTORE_PREFIX_LOAD_DEADLINE_MS` (how long a new request waits for its stored prefix, and at
    most half its class's queue timeout; then it computes the prompt; default 5000),
    `_KVSTORE_WRITE_BUFFER_MB` (host memory writes may hold while they wait for the kvstore; a
    write past it is dropped; default 2048),
    `_KVSTORE_RETRY_AFTER_S` (loads skipped after a failure, default 5), `_COLD_PREFIX_REUSE`
    (store prompt blocks, load stored prefixes; default on),
    `_RETRIEVAL_MODE` (off or semantic: the default of requests and classes that set none),
    `_AUX_WINDOW_TOKENS` (cold tokens attended per sequence, default 2048),
    `_AUX_SCORE_EVERY_STEPS` (decode steps between scorings, default 16), `_AUX_SCORE_LAYER` (the
    layer whose query scores the cold blocks; default -1, the middle layer), `_AUX_PREFETCH_BLOCKS`
    (runner-up cold blocks staged in the kvstore's RAM at each scoring; default -1, as many as the
    window holds; 0 off), `_COLD_PRUNE_TOKENS`
    (drop the least-attended tokens of demoted blocks, by the key-norm proxy; default off),
    `_KVSTORE_LOCAL_READS` (read a prefix's records from the kvstore's segment files directly; needs
    a kvstore on this host that serves locations; default off) and `_COLD_PREFIX_STAGING_MB` (the
    host buffer prefix hits land in, kept for the engine's life; default 8192, 0 = one per hit).
    """

    server: ServerConfig
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 16
    max_seq_len: int = 0
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_prefill_tokens: int = 4096
    max_queued_counts: int = 64  # CountTokens calls on or waiting for their pool (serving/tokenizing.py)
    mixed_steps: bool = True  # decode rows ride along prompt chunks (Scheduler)
    warm_up: bool = True  # compile the fused prefill kernels at start-up (LLMEngine.warm_up)
    kv: KVCacheSpec = field(default_factory=KVCacheSpec)
    intent_classes_file: str | None = None
    gate: GateConfig = field(default_factory=GateConfig)
    tp: int = 1
    attention: str = "auto"  # attention backend: auto (Triton on CUDA, reference on CPU), reference, triton
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    overlap: bool | None = None  # launch a decode step before the last one's sync; None: with CUDA graphs
    cold: ColdTierConfig = field(default_factory=ColdTierConfig)  # the kvstore tier (off: no target)

    def intent_classes(self) -> IntentClasses:
        """The configured classes (read from the file when one is set)."""
        if self.intent_classes_file is None:
            return IntentClasses.builtin()
        return IntentClasses.load(self.intent_classes_file)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"THERMOCLINE_ENGINE_MAX_BATCH_SIZE must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len < 0:
            raise ValueError(f"THERMOCLINE_ENGINE_MAX_SEQ_LEN must be >= 0, got {self.max_seq_len}")
        if self.max_queued_counts < 1:
            raise ValueError(
                f"THERMOCLINE_ENGINE_MAX_QUEUED_COUNTS must be >= 1, got {self.max_queued_counts}"
            )
        if self.tp < 1:
            raise ValueError(f"THERMOCLINE_ENGINE_TP must be >= 1, got {self.tp}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"THERMOCLINE_ENGINE_DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must lie in "
                f"1..THERMOCLINE_ENGINE_MAX_TOKENS_LIMIT ({self.max_tokens_limit})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """Reads the engine's settings."""
        prefix = "THERMOCLINE_ENGINE_"
        return cls(
            server=ServerConfig.from_env("engine", DEFAULT_PORT, environ),
            model=env.get_str(prefix + "MODEL", DEFAULT_MODEL, environ),
            device=env.get_str(prefix + "DEVICE", "auto", environ),
            dtype=env.get_str(prefix + "DTYPE", "auto", environ),
            max_batch_size=env.get_int(prefix + "MAX_BATCH_SIZE", 16, environ),
            max_seq_len=env.get_int(prefix + "MAX_SEQ_LEN", 0, environ),
            default_max_tokens=env.get_int(prefix + "DEFAULT_MAX_TOKENS", 256, environ),
            max_tokens_limit=env.get_int(prefix + "MAX_TOKENS_LIMIT", 4096, environ),
            max_prefill_tokens=env.get_int(prefix + "MAX_PREFILL_TOKENS", 4096, environ),
            max_queued_counts=env.get_int(prefix + "MAX_QUEUED_COUNTS", 64, environ),
            mixed_steps=env.get_bool(prefix + "MIXED_STEPS", True, environ),
            warm_up=env.get_bool(prefix + "WARM_UP", True, environ),
            kv=_kv_from_env(prefix + "KV_", environ),
            intent_classes_file=env.get_optional_str(prefix + "INTENT_CLASSES", environ),
            gate=_gate_from_env(prefix, environ),
            tp=env.get_int(prefix + "TP", 1, environ),
            attention=env.get_str(prefix + "ATTENTION", "auto", environ),
            cuda_graphs=env.get_bool(prefix + "CUDA_GRAPHS", True, environ),
            overlap=_overlap_from_env(prefix + "OVERLAP", environ),
            cold=_cold_from_env(prefix, environ),
        )


def _overlap_from_env(name: str, environ: Mapping[str, str] | None) -> bool | None:
    """`auto` (the default: on with CUDA graphs), or a boolean."""
    if env.get_str(name, "auto", environ).strip().lower() == "auto":
        return None
    return env.get_bool(name, False, environ)


def _kv_from_env(prefix: str, environ: Mapping[str, str] | None) -> KVCacheSpec:
    defaults = TierConfig()
    policy = env.get_str(prefix + "WARM_POLICY", defaults.policy.value, environ)
    if policy not in {p.value for p in WarmFullPolicy}:
        raise env.EnvError(f"{prefix}WARM_POLICY={policy!r} must be 'window' or 'refuse'")
    tiers = TierConfig(
        enabled=env.get_bool(prefix + "TIERS", False, environ),
        sink_tokens=env.get_int(prefix + "SINK_TOKENS", defaults.sink_tokens, environ),
        hot_tokens=env.get_int(prefix + "HOT_TOKENS", defaults.hot_tokens, environ),
        warm_tokens=env.get_int(prefix + "WARM_TOKENS", defaults.warm_tokens, environ),
        group_size=env.get_int(prefix + "GROUP_SIZE", defaults.group_size, environ),
        policy=WarmFullPolicy(policy),
        max_hot_tokens=env.get_int(prefix + "MAX_HOT_TOKENS", defaults.max_hot_tokens, environ),
        grow_below_hot_mass=env.get_float(
            prefix + "GROW_BELOW_HOT_MASS", defaults.grow_below_hot_mass, environ
        ),
        restart_hot_at_turns=env.get_bool(
            prefix + "RESTART_HOT_AT_TURNS", defaults.restart_hot_at_turns, environ
        ),
    )
    engine = prefix.removesuffix("KV_")
    return KVCacheSpec(
        gpu_memory_utilization=env.get_float(engine + "GPU_MEMORY_UTILIZATION", 0.90, environ),
        cpu_cache_mb=env.get_int(engine + "CPU_KV_CACHE_MB", 512, environ),
        block_size=env.get_int(prefix + "BLOCK_SIZE", 16, environ),
        num_hot_blocks=env.get_int(prefix + "HOT_BLOCKS", 0, environ),
        num_warm_groups=env.get_int(prefix + "WARM_GROUPS", 0, environ),
        tiers=tiers,
    )


def _cold_from_env(prefix: str, environ: Mapping[str, str] | None) -> ColdTierConfig:
    defaults = ColdTierConfig()
    return ColdTierConfig(
        target=env.get_str(prefix + "KVSTORE_TARGET", "", environ),
        deadline_ms=env.get_int(prefix + "KVSTORE_DEADLINE_MS", defaults.deadline_ms, environ),
        transfer_deadline_ms=env.get_int(
            prefix + "KVSTORE_TRANSFER_DEADLINE_MS", defaults.transfer_deadline_ms, environ
        ),
        prefix_load_deadline_ms=env.get_int(
            prefix + "KVSTORE_PREFIX_LOAD_DEADLINE_MS", defaults.prefix_load_deadline_ms, environ
        ),
        write_buffer_mb=env.get_int(prefix + "KVSTORE_WRITE_BUFFER_MB", defaults.write_buffer_mb, environ),
        retry_after_s=env.get_float(prefix + "KVSTORE_RETRY_AFTER_S", defaults.retry_after_s, environ),
        prefix_reuse=env.get_bool(prefix + "COLD_PREFIX_REUSE", defaults.prefix_reuse, environ),
        retrieval_mode=_choice(prefix + "RETRIEVAL_MODE", RetrievalMode, defaults.retrieval_mode, environ),
        aux_window_tokens=env.get_int(prefix + "AUX_WINDOW_TOKENS", defaults.aux_window_tokens, environ),
        score_every_steps=env.get_int(prefix + "AUX_SCORE_EVERY_STEPS", defaults.score_every_steps, environ),
        score_layer=env.get_int(prefix + "AUX_SCORE_LAYER", defaults.score_layer, environ),
        prefetch_blocks=env.get_int(prefix + "AUX_PREFETCH_BLOCKS", defaults.prefetch_blocks, environ),
        prune_tokens=env.get_bool(prefix + "COLD_PRUNE_TOKENS", defaults.prune_tokens, environ),
        local_reads=env.get_bool(prefix + "KVSTORE_LOCAL_READS", defaults.local_reads, environ),
        prefix_staging_mb=env.get_int(prefix + "COLD_PREFIX_STAGING_MB", defaults.prefix_staging_mb, environ),
    )


def _gate_from_env(prefix: str, environ: Mapping[str, str] | None) -> GateConfig:
    defaults = GateConfig()
    source = _choice(prefix + "GATE_SOURCE", GateSource, defaults.source, environ)
    mismatch = _choice(prefix + "GATE_MISMATCH", MismatchPolicy, defaults.mismatch, environ)
    return GateConfig(
        source=source,
        file=Path(env.get_str(prefix + "GATE_FILE", str(DEFAULT_GATE_FILE), environ)),
        safety_target=env.get_optional_str(prefix + "SAFETY_TARGET", environ),
        mismatch=mismatch,
        safe_message=env.get_str(prefix + "SAFE_MESSAGE", defaults.safe_message, environ),
        safety_timeout_s=env.get_float(prefix + "SAFETY_TIMEOUT_S", defaults.safety_timeout_s, environ),
        recheck_s=env.get_float(prefix + "GATE_RECHECK_S", defaults.recheck_s, environ),
    )


def _choice(name: str, kind: type[_Choice], default: _Choice, environ: Mapping[str, str] | None) -> _Choice:
    value = env.get_str(name, default.value, environ).lower()
    choices = [c.value for c in kind]
    if value not in choices:
        raise env.EnvError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return kind(value)
