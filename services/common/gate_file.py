"""The safety gate file: one safetensors file of head weights plus a JSON manifest beside it.

Both the safety service and the engine read this module, so it depends on nothing in the
project: only the standard library, torch and safetensors. The manifest holds:

- `format`: "thermocline-gate/2";
- `version`: a human label, e.g. "2026.11.30";
- `sha256`: the hex sha256 of the safetensors file's bytes (what `GetGate` announces);
- `manifest_sha256`: the hex sha256 of the manifest itself, less this one field, as canonical JSON
  (`manifest_digest`): it covers the thresholds, the heads and `sha256`, so a manifest edited after
  it was written is refused, not served as the same gate (format 1 hashed the weights alone, and a
  threshold set to 1.0 in the JSON went unnoticed);
- `categories`: the risk categories, in the order of the heads' outputs;
- `heads`: one entry per head. Each names its tensor prefix (`<prefix>.weight` `[C + 1, H]`,
  `<prefix>.bias` `[C + 1]`; row 0 is the benign class), its per-category `thresholds`, and
  its `features`: what the head reads (for the engine head: the model, the layer and the
  hidden size). A head may also carry `output_thresholds`, per category, for screening model
  outputs rather than prompts: benign answers near a harmful topic (refusals, safety advice)
  score higher than benign prompts, so a threshold calibrated on prompts blocks too many of
  them. A head without `output_thresholds` screens outputs with its `thresholds`.

The heads a gate may hold: `prompt` (the safety service's screen of prompts, and of outputs when
there is no `output` head), `output` (optional: the output screen's own head, judged at its
`thresholds`, so that training data for prompts cannot move what the output screen blocks) and
`engine` (the in-loop gate).

Loading refuses a file whose hash differs from the manifest's, naming both hashes, and a manifest
whose own hash differs from its `manifest_sha256`. A manifest edited on purpose is sealed again
with `python -m services.common.gate_file seal <gate.safetensors>` (`seal_gate`), which is also how
a format-1 manifest becomes format 2.

`gate_scores` is the reference form of a head. The engine does not call it per step: at
start-up services/engine/gate/safety_gate.py folds the engine head and its thresholds into one matrix
and one limit per category (`InLoopGate`). The engine head was trained on the last token of
prompts and outputs, not on every position of a generation, so scores at mid-generation steps
are less calibrated than at the prompt's end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

FORMAT = "thermocline-gate/2"
_UNSEALED_FORMATS = ("thermocline-gate/1",)  # formats whose manifest carries no manifest_sha256
MANIFEST_HASH_KEY = "manifest_sha256"
PROMPT_HEAD = "prompt"  # reads sentence embeddings of the text (the safety service's screen)
ENGINE_HEAD = "engine"  # reads the serving model's final normed hidden state (the in-loop gate)
OUTPUT_HEAD = "output"  # optional: reads sentence embeddings of model outputs (the output screen)


class GateFileError(ValueError):
    """The gate file or its manifest cannot be used; the message says which and why."""


class GateHashMismatch(GateFileError):
    """The weights' sha256 is not the one the manifest (or the safety service) announces."""


class GateManifestMismatch(GateFileError):
    """The manifest does not hash to its own `manifest_sha256`: it was edited after it was written."""


@dataclass(frozen=True)
class HeadSpec:
    """One linear head of the gate: what it reads and where it blocks."""

    name: str
    features: dict[str, Any]
    thresholds: dict[str, float]
    output_thresholds: dict[str, float]  # the manifest's, or `thresholds` when it has none


@dataclass(frozen=True)
class GateManifest:
    """The parsed manifest."""

    version: str
    sha256: str
    categories: tuple[str, ...]
    heads: dict[str, HeadSpec]
    raw: dict[str, Any]
    manifest_sha256: str  # as the manifest states it; parse_gate checks it against manifest_digest

    @classmethod
    def parse(cls, text: str) -> GateManifest:
        """Validates the manifest JSON; GateFileError names the first problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise GateFileError(f"gate manifest is not JSON: {error}") from None
        if isinstance(raw, dict) and raw.get("format") in _UNSEALED_FORMATS:
            raise GateFileError(
                f"gate manifest format {raw['format']!r} hashes the weights only, not the manifest's "
                f"thresholds; check them, then seal it as {FORMAT!r} with "
                "`python -m services.common.gate_file seal <gate.safetensors>`"
            )
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise GateFileError(f"gate manifest format must be {FORMAT!r}")
        categories = tuple(_require(raw, "categories", list))
        heads = {
            name: _parse_head(name, spec, categories) for name, spec in _require(raw, "heads", dict).items()
        }
        version, sha256 = _require(raw, "version", str), _require(raw, "sha256", str).lower()
        return cls(version, sha256, categories, heads, raw, _require(raw, MANIFEST_HASH_KEY, str).lower())

    def head(self, name: str) -> HeadSpec:
        """The named head; GateFileError when the gate has none."""
        if name not in self.heads:
            raise GateFileError(f"gate {self.version} has no {name!r} head; it has {sorted(self.heads)}")
        return self.heads[name]


def manifest_digest(raw: dict[str, Any]) -> str:
    """The hex sha256 of a manifest less its `manifest_sha256`, as canonical JSON (sorted keys, no
    spaces, ASCII): the same for any layout or key order of the file."""
    rest = {key: value for key, value in raw.items() if key != MANIFEST_HASH_KEY}
    return sha256_hex(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _require(raw: dict[str, Any], key: str, kind: type) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind) or not value:
        raise GateFileError(f"gate manifest needs a non-empty {kind.__name__} {key!r}")
    return value


def _parse_head(name: str, spec: Any, categories: tuple[str, ...]) -> HeadSpec:
    if not isinstance(spec, dict):
        raise GateFileError(f"gate manifest head {name!r} must be an object")
    thresholds = _parse_thresholds(name, "thresholds", _require(spec, "thresholds", dict), categories)
    output_thresholds = thresholds
    if "output_thresholds" in spec:
        raw = _require(spec, "output_thresholds", dict)
        output_thresholds = _parse_thresholds(name, "output_thresholds", raw, categories)
    features = _require(spec, "features", dict)
    return HeadSpec(name, features, thresholds, output_thresholds)


def _parse_thresholds(
    name: str, key: str, thresholds: dict[str, Any], categories: tuple[str, ...]
) -> dict[str, float]:
    if set(thresholds) != set(categories):
        raise GateFileError(f"head {name!r} {key} must name exactly the categories {list(categories)}")
    if not all(isinstance(t, int | float) and 0.0 < t <= 1.0 for t in thresholds.values()):
        raise GateFileError(f"head {name!r} {key} must lie in (0, 1]")
    return {c: float(thresholds[c]) for c in categories}


@dataclass(frozen=True)
class Gate:
    """A verified gate: its manifest, its bytes and its tensors."""

    manifest: GateManifest
    manifest_json: str
    weights_bytes: bytes
    tensors: dict[str, torch.Tensor]

    @property
    def version(self) -> str:
        """The manifest's version label."""
        return self.manifest.version

    @property
    def sha256(self) -> str:
        """The verified hex sha256 of the weights."""
        return self.manifest.sha256

    @property
    def manifest_sha256(self) -> str:
        """The verified hex sha256 of the manifest (thresholds included; see manifest_digest)."""
        return self.manifest.manifest_sha256

    def head_weights(self, name: str, for_outputs: bool = False) -> HeadWeights:
        """The named head's tensors, with its thresholds (for outputs: its output thresholds)
        in category order."""
        spec = self.manifest.head(name)
        thresholds = spec.output_thresholds if for_outputs else spec.thresholds
        return HeadWeights(
            weight=self.tensors[f"{name}.weight"],
            bias=self.tensors[f"{name}.bias"],
            thresholds=torch.tensor([thresholds[c] for c in self.manifest.categories]),
        )


@dataclass(frozen=True)
class HeadWeights:
    """What `gate_scores` needs: a linear layer over benign + C categories, and C thresholds."""

    weight: torch.Tensor  # [C + 1, H] fp32
    bias: torch.Tensor  # [C + 1] fp32
    thresholds: torch.Tensor  # [C] fp32


def gate_scores(hidden: torch.Tensor, weights: HeadWeights) -> torch.Tensor:
    """Per-category risk `[B, C]` in [0, 1] from features `[B, H]`.

    The head is a softmax over benign + C; a category's risk is the probability of it against
    benign alone, sigmoid(logit_c - logit_benign), so a text whose harm is split between two
    categories still scores high in both. `gate_scores(...) >= weights.thresholds` is the block
    mask; the engine's `InLoopGate` computes the same mask folded into one matmul and compare.
    """
    logits = hidden.to(weights.weight.dtype) @ weights.weight.T + weights.bias  # [B, C + 1]
    return torch.sigmoid(logits[:, 1:] - logits[:, :1])  # [B, C]


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def manifest_path_for(weights_path: Path) -> Path:
    """The manifest beside a weights file: `gate.safetensors` -> `gate.json`."""
    return weights_path.with_suffix(".json")


def parse_gate(manifest_json: str, weights_bytes: bytes, expected_sha256: str | None = None) -> Gate:
    """A Gate from bytes (e.g. a GetGate reply); GateManifestMismatch when the manifest does not
    hash to its manifest_sha256, GateHashMismatch when the weights' hash disagrees with it or with
    `expected_sha256`."""
    manifest = GateManifest.parse(manifest_json)
    if (digest := manifest_digest(manifest.raw)) != manifest.manifest_sha256:
        raise GateManifestMismatch(
            f"gate {manifest.version}: the manifest hashes to {digest}, but its {MANIFEST_HASH_KEY} "
            f"is {manifest.manifest_sha256}; it was edited after it was written (its thresholds may "
            "not be the gate's). Restore it, or check the edit and seal it again with "
            "`python -m services.common.gate_file seal <gate.safetensors>`"
        )
    actual = sha256_hex(weights_bytes)
    for source, expected in (("manifest", manifest.sha256), ("announced", expected_sha256)):
        if expected is not None and expected.lower() != actual:
            raise GateHashMismatch(
                f"gate {manifest.version}: the weights hash to sha256 {actual}, but the {source} "
                f"sha256 is {expected.lower()}; the file was changed or belongs to another manifest"
            )
    tensors = load_safetensors(weights_bytes)
    _check_tensors(manifest, tensors)
    return Gate(manifest, manifest_json, weights_bytes, tensors)


def load_gate(weights_path: Path, expected_sha256: str | None = None) -> Gate:
    """Reads and verifies the gate at `weights_path` and its manifest beside it."""
    manifest_path = manifest_path_for(weights_path)
    try:
        weights_bytes = weights_path.read_bytes()
        manifest_json = manifest_path.read_text()
    except OSError as error:
        raise GateFileError(f"cannot read gate file {error.filename}: {error.strerror}") from None
    return parse_gate(manifest_json, weights_bytes, expected_sha256)


# The width of the features each sentence embedder named in a head's `features.embedder` gives.
EMBEDDER_WIDTHS = {"sentence-transformers/all-MiniLM-L6-v2": 384}


def _check_tensors(manifest: GateManifest, tensors: dict[str, torch.Tensor]) -> None:
    """GateFileError for a tensor that is not finite (a NaN head never blocks: NaN >= threshold is
    false) or a head whose shape is not [C + 1, H] over the width of what it reads (one that fits
    no input failed every check, INTERNAL, instead of failing to load)."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise GateFileError(f"gate {manifest.version}: tensor {key!r} holds NaN or infinite values")
    num_classes = len(manifest.categories) + 1
    for name, spec in manifest.heads.items():
        weight, bias = tensors.get(f"{name}.weight"), tensors.get(f"{name}.bias")
        if weight is None or bias is None:
            raise GateFileError(f"gate {manifest.version}: head {name!r} lacks its weight or bias tensor")
        width = _input_width(spec)
        expected = (num_classes, width if width is not None else weight.shape[-1])
        if tuple(weight.shape) != expected or tuple(bias.shape) != (num_classes,):
            raise GateFileError(
                f"gate {manifest.version}: head {name!r} has weight {tuple(weight.shape)} and bias "
                f"{tuple(bias.shape)}; expected [{num_classes}, {width or 'H'}] and [{num_classes}]"
            )


def _input_width(spec: HeadSpec) -> int | None:
    """The width of the features a head reads: its `features.hidden_size` (the engine head: the
    engine checks it against its model's), else its embedder's; None when the manifest names
    neither (a test gate)."""
    if "hidden_size" in spec.features:
        return int(spec.features["hidden_size"])
    return EMBEDDER_WIDTHS.get(spec.features.get("embedder", ""))


def write_gate(weights_path: Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> str:
    """Writes the weights and the manifest (with its format, sha256 and manifest_sha256 filled in,
    whatever `manifest` held under those keys); returns the sha256."""
    from safetensors.torch import save

    data = save({k: v.contiguous().to(torch.float32) for k, v in tensors.items()})
    digest = sha256_hex(data)
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    weights_path.write_bytes(data)
    _write_manifest(weights_path, {**manifest, "format": FORMAT, "sha256": digest})
    return digest


def seal_gate(weights_path: Path) -> str:
    """Seals the manifest beside `weights_path` as FORMAT with its manifest_sha256 (after an edit
    made on purpose, or to lift a format-1 manifest); returns that hash. GateHashMismatch when the
    weights do not hash to the manifest's sha256: sealing vouches for the manifest, never for
    other weights."""
    raw = json.loads(manifest_path_for(weights_path).read_text())
    actual = sha256_hex(weights_path.read_bytes())
    if str(raw.get("sha256", "")).lower() != actual:
        raise GateHashMismatch(
            f"{weights_path} hashes to sha256 {actual}, but its manifest says {raw.get('sha256')}; not sealed"
        )
    return _write_manifest(weights_path, {**raw, "format": FORMAT})


def _write_manifest(weights_path: Path, manifest: dict[str, Any]) -> str:
    document = {**manifest, MANIFEST_HASH_KEY: manifest_digest(manifest)}
    manifest_path_for(weights_path).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return document[MANIFEST_HASH_KEY]


def main() -> None:
    """`python -m services.common.gate_file seal <gate.safetensors>`: see seal_gate."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=["seal"])
    parser.add_argument("weights", type=Path, help="the gate's .safetensors (its .json beside it)")
    args = parser.parse_args()
    print(f"{manifest_path_for(args.weights)}: manifest_sha256 {seal_gate(args.weights)}")


if __name__ == "__main__":
    main()
