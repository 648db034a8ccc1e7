"""`python -m services.engine`: loads the model, then serves it."""

from __future__ import annotations

import gc
import logging

from services.common.server import ServiceSpec, run_service, setup_logging
from services.engine.config import EngineConfig
from services.engine.gate.gate_loader import hold_gate, served_model
from services.engine.gate.gate_watch import GateWatch
from services.engine.llm_engine import LLMEngine
from services.engine.model.registry import resolve_model
from services.engine.serving.servicer import register

log = logging.getLogger(__name__)


def main() -> None:
    """Loads the configured model (health stays down until it is ready) and serves it."""
    config = EngineConfig.from_env()
    setup_logging(config.server.log_level)
    path = resolve_model(config.model)
    engine = LLMEngine.load(
        path,
        device=config.device,
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len or None,
        kv=config.kv,
        classes=config.intent_classes(),
        max_prefill_tokens=config.max_prefill_tokens,
        tp=config.tp,
        attention=config.attention,
        cuda_graphs=config.cuda_graphs,
        cold=config.cold,
        overlap=config.overlap,
        mixed_steps=config.mixed_steps,
        warm_up=config.warm_up,
    )
    log.info("loaded %s on %s (tp=%d)", engine.model_id, engine.runner.device, config.tp)
    model = served_model(config.model, path, engine.model_id, engine.config.hidden_size)
    gate = GateWatch(config.gate, model, hold_gate(config.gate, model, engine.runner.device))
    engine.set_safety_gate(*gate.loaded)
    # What is loaded by now lives as long as the process. Frozen, it is left out of every later
    # garbage collection: a full collection walks every tracked object, and at large batches its
    # pause (tens of milliseconds) lands on the step thread, whose decode steps take a few.
    gc.collect()
    gc.freeze()
    engine.start()

    async def watch_gate() -> None:
        gate.start(engine.set_safety_gate)  # safety's announcement, re-checked while serving

    async def stop_engine() -> None:
        await gate.stop()
        engine.stop()

    run_service(
        ServiceSpec(
            config=config.server,
            register=lambda server: register(server, config, engine),
            on_start=watch_gate,
            on_stop=stop_engine,
            health_probe=engine.health_problem,
            readiness_probe=gate.readiness_problem,  # refusing every Generate: live, not ready
        )
    )


if __name__ == "__main__":
    main()
