"""stories260K whose output head overflows at the lowest temperature: a real numerical fault.

Eight rows of `lm_head` are scaled by 1e37. Their logits stay finite (greedy decoding is unchanged:
they come out negative for "Once upon a time"), but divided by a temperature of 1e-3 they pass
fp32's largest value, so a request sampled at that temperature ends with a sampling fault, through
the public API and with no code patched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

FAULTING_TEMPERATURE = 1e-3  # the lowest the engine and the gateway accept


def make_overflow_stories(hf_dir: Path, out: Path) -> Path:
    """A copy of stories260K at `out` with the scaled head rows."""
    shutil.copytree(hf_dir, out)
    for path in out.iterdir():
        path.chmod(0o644)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"][3:11] *= 1e37  # [V, D]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
