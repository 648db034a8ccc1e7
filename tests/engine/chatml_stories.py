"""stories260K with a ChatML template whose turn markers are added tokens not marked special.

HF tokenizers mark some added tokens so (fine-tunes that add ChatML through `added_tokens.json`), and
the GGUF loader adds every USER_DEFINED token so. The embedding and head gain two rows for them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
# ChatML that writes consecutive messages of one role as one turn, their texts side by side (templates
# that merge turns so exist): a marker split across two messages forms where they meet.
MERGING_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first or message['role'] != messages[loop.index0 - 1]['role'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{% endif %}{{ message['content'] }}"
    "{% if loop.last or message['role'] != messages[loop.index0 + 1]['role'] %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_chatml_stories(hf_dir: Path, out: Path, chat_template: str = CHATML_TEMPLATE) -> Path:
    """A copy of stories260K at `out` whose markers are ids 512 and 513 (vocabulary 514)."""
    shutil.copytree(hf_dir, out)
    for path in out.iterdir():
        path.chmod(0o644)
    _add_markers(out / "tokenizer.json", first_id=512)
    _edit_json(out / "tokenizer_config.json", chat_template=chat_template)
    _edit_json(out / "config.json", vocab_size=514)
    weights = load_file(out / "model.safetensors")
    for name, weight in weights.items():
        if weight.dim() == 2 and weight.shape[0] == 512:  # embedding and head: [V, D]
            weights[name] = torch.cat([weight, weight[:2]]).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _add_markers(path: Path, first_id: int) -> None:
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
    for offset, content in enumerate((TURN_START, TURN_END)):
        tokenizer["added_tokens"].append({"id": first_id + offset, "content": content, **flags})
    path.write_text(json.dumps(tokenizer), encoding="utf-8")


def _edit_json(path: Path, **values: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text(encoding="utf-8")) | values), encoding="utf-8")
