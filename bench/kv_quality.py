"""KV tier quality: perplexity and per-token KL of hot + INT4-warm attention against full attention.

Runs SmolLM2-135M-Instruct in fp32 (on the CPU, or a CUDA device with TF32 off) over a fixed
English text, feeding it in chunks of `--chunk` tokens: each chunk attends to the tiered cache of
everything before it (sink + hot in fp32, the rest INT4 KIVI) and to itself exactly, then full
groups are demoted, as in decode.
The reference is the same chunked run with tiers off (every token hot, full precision).

The text is Ambrose Bierce's _The Devil's Dictionary_ as Debian's `dict-devil` package installs it
(`tools/setup.sh`, which `make test` and `make bench` run, installs it; see TEXT_SOURCE).

    .venv/bin/python bench/kv_quality.py --contexts 512 2048 --out bench/results/kv_quality_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from services.engine.attention.metadata import AttentionMetadata, RowInput
from services.engine.attention.reference import ReferenceBackend
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.tiers import TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model.llama import LlamaModel

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
SINK_TOKENS = 4
# Debian's dict-devil 1.0-13.1 (bookworm): the dictd database of the Internet Wiretap edition (1993).
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
TEXT_SOURCE = (
    "Ambrose Bierce, _The Devil's Dictionary_ (written 1881-1906, copyright 1911), public domain "
    "(copyright expired; Debian's copyright file for the package: \"The Devil's Dictionary is in the "
    "public domain, its copyright has expired\"), the Internet Wiretap edition of 1993 as Debian's "
    "package `dict-devil` 1.0-13.1 installs it in `/usr/share/dictd/devil.dict.dz` (a dictd "
    "database, read with its `devil.index`): Bierce's preface, then all 999 entries in file "
    "(alphabetical) order; stripped: the dictd headers `00-database-*` (dictfmt's name, URL and "
    "alphabet entries, and the Wiretap edition's title and release notice before the preface)"
)


def load_text(path: Path = DEVIL_DICT) -> str:
    """The preface and the entries of The Devil's Dictionary, from dict-devil's dictd database.

    A `.dict.dz` file is gzip (dictzip adds a seek table in the header's extra field); the
    `.index` beside it lists `headword<TAB>offset<TAB>length`, numbers in dictd's base64 digits.
    Several headwords can share one entry, so spans are deduplicated.
    """
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: install Debian's dict-devil (`tools/setup.sh` does), "
            "or pass --text-file with a copy of devil.dict.dz and devil.index beside it"
        )
    data = gzip.decompress(path.read_bytes())
    index = path.with_name(path.name.removesuffix(".dict.dz") + ".index")
    entries: set[tuple[int, int]] = set()
    info = ""
    for line in index.read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        start, size = _dictd_number(offset), _dictd_number(length)
        if headword == "00databaseinfo":
            info = data[start : start + size].decode("utf-8")
        elif not headword.startswith("00database"):
            entries.add((start, size))
    if "PREFACE" not in info:
        raise ValueError(f"{index}: no 00-database-info entry holding the preface")
    preface = info[info.index("PREFACE") :].strip()
    body = b"".join(data[start : start + size] for start, size in sorted(entries)).decode("utf-8")
    return preface + "\n\n" + body


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(digits: str) -> int:
    """A dictd index number: base64 digits (A-Z, a-z, 0-9, +, /), most significant first."""
    value = 0
    for char in digits:
        value = value * 64 + _B64.index(char)
    return value


@dataclass(frozen=True)
class Setting:
    """One tier configuration; `tiers=None` is the full-attention reference."""

    name: str
    tiers: TierConfig | None


@dataclass(frozen=True)
class Row:
    """One table row of the results."""

    context: int
    setting: str
    perplexity: float
    mean_kl: float
    p99_kl: float
    max_kl: float
    kv_bytes_per_token_fp32: float
    kv_bytes_per_token_bf16: float
    seconds: float


def run_chunked(
    model: LlamaModel, ids: list[int], tiers: TierConfig | None, chunk: int
) -> tuple[torch.Tensor, KVCache]:
    """Log-probabilities `[N-1, V]` for each next token, and the cache in its final state."""
    config = model.config
    device = model.embed_tokens.weight.device
    num_blocks = len(ids) // BLOCK_SIZE + 2
    hot = HotTier(config, num_blocks, BLOCK_SIZE, device, torch.float32)
    warm = WarmTier(config, len(ids) // tiers.group_size + 1, tiers.group_size, device) if tiers else None
    cache = KVCache(hot, warm)
    table = BlockTable(tiers or TierConfig())
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : min(start + chunk, len(ids) - 1)]
            cache.grow(table, start + len(piece))
            cache.copy_to_warm(cache.take_warm_copies())  # the last chunk's demotions, as the runner does
            rows = [RowInput(table, start, len(piece))]
            metadata = AttentionMetadata.for_rows(rows, BLOCK_SIZE, cache.blocks_per_group, device)
            hidden = model(
                torch.tensor(piece, device=device), cache, ReferenceBackend(cache), metadata
            )  # [S, E]
            outputs.append(F.log_softmax(model.compute_logits(hidden), dim=-1))
            cache.register_full_blocks(table, start + len(piece))
            cache.demote(table, start + len(piece))
    return torch.cat(outputs), cache


def kv_bytes_per_token(cache: KVCache, num_tokens: int) -> tuple[float, float]:
    """Mean device bytes per cached token at the end of the run, with hot in fp32 and as if bf16."""
    hot_tokens = cache.hot.num_used_tokens()
    warm_bytes = cache.warm.used_bytes() if cache.warm else 0
    hot_fp32 = hot_tokens * cache.hot.bytes_per_token
    return (hot_fp32 + warm_bytes) / num_tokens, (hot_fp32 / 2 + warm_bytes) / num_tokens


def measure(
    model: LlamaModel, ids: list[int], setting: Setting, reference: torch.Tensor | None, chunk: int
) -> tuple[Row, torch.Tensor]:
    """One setting at one context length."""
    began = time.perf_counter()
    logprobs, cache = run_chunked(model, ids, setting.tiers, chunk)
    if logprobs.is_cuda:
        torch.cuda.synchronize(logprobs.device)
    seconds = time.perf_counter() - began
    targets = torch.tensor(ids[1:], device=logprobs.device)
    nll = -logprobs.gather(1, targets.view(-1, 1)).squeeze(1)
    base = reference if reference is not None else logprobs
    kl = (base.exp() * (base - logprobs)).sum(-1).clamp_min(0)  # KL(full || tiered) per token
    fp32, bf16 = kv_bytes_per_token(cache, len(ids))
    row = Row(
        context=len(ids),
        setting=setting.name,
        perplexity=math.exp(nll.mean().item()),
        mean_kl=kl.mean().item(),
        p99_kl=kl.quantile(0.99).item(),
        max_kl=kl.max().item(),
        kv_bytes_per_token_fp32=fp32,
        kv_bytes_per_token_bf16=bf16,
        seconds=seconds,
    )
    return row, logprobs


def settings(hot_sizes: list[int], group_sizes: list[int]) -> list[Setting]:
    """The reference, then every hot size with every group size (warm holds the rest, nothing dropped)."""
    out = [Setting("full attention (tiers off)", None)]
    for hot in hot_sizes:
        for group in group_sizes:
            tiers = TierConfig(
                enabled=True, sink_tokens=SINK_TOKENS, hot_tokens=hot, warm_tokens=1 << 20, group_size=group
            )
            out.append(Setting(f"hot {hot} + INT4 warm, group {group}", tiers))
    return out


def environment(device: torch.device, commit: str | None) -> dict[str, str]:
    """Date, commit, machine, device and library versions for the results header."""
    if commit is None:  # a copy of the tree without git (the GPU machine) passes --commit instead
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "services/engine", "bench/kv_quality.py"],
                capture_output=True,
                text=True,
            ).stdout
            commit += " (engine or bench files modified)" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown (no git here; pass --commit)"
    cpu = cpu_name()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, fp32 "
            f"with TF32 off; host {cpu}, {os.cpu_count()} logical CPUs"
        )
    else:
        where = f"CPU {cpu}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "device": where,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def to_markdown(rows: list[Row], env: dict[str, str], args: argparse.Namespace, num_text_tokens: int) -> str:
    """The results file."""
    lines = [
        "# KV tier quality: SmolLM2-135M-Instruct, hot fp32 + INT4 KIVI warm vs full attention",
        "",
        f"- date: {env['date']}; commit: {env['commit']}",
        f"- device: {env['device']}; torch {env['torch']}, Python {env['python']}",
        f"- model: `{MODEL}` (Q4_1 GGUF dequantized to fp32, weights and KV in fp32)",
        f"- text: {TEXT_SOURCE}; each context N takes its first N tokens "
        f"(SmolLM2 tokenizer; {num_text_tokens} tokens encoded from the first {8 * max(args.contexts)} "
        "characters)",
        f"- settings: block size {BLOCK_SIZE}, sink {SINK_TOKENS} tokens (one block stays hot), "
        f"chunk {args.chunk} tokens per step (a chunk sees itself exactly), warm unbounded (nothing dropped)",
        "- KL: KL(full || tiered) in nats per predicted token, over all N-1 positions (the first "
        "sink + hot + group tokens are exact by construction, so they pull the mean down)",
        "- KV bytes/token: device bytes of the cache at the end of the run divided by N; `bf16` "
        "counts hot tokens at 2 bytes (the GPU serving dtype), `fp32` at 4 (this run)",
        f"- reproduce: `{_reproduce(args)}`",
        "",
        "| context | setting | perplexity | mean KL | p99 KL | max KL | KV bytes/token (bf16 hot) "
        "| KV bytes/token (fp32 hot) | seconds |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.context} | {r.setting} | {r.perplexity:.3f} | {r.mean_kl:.5f} | {r.p99_kl:.4f} | "
            f"{r.max_kl:.4f} | {r.kv_bytes_per_token_bf16:,.0f} | {r.kv_bytes_per_token_fp32:,.0f} "
            f"| {r.seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _reproduce(args: argparse.Namespace) -> str:
    command = (
        f".venv/bin/python bench/kv_quality.py --contexts {_ints(args.contexts)} --hot {_ints(args.hot)} "
        f"--groups {_ints(args.groups)} --chunk {args.chunk}"
    )
    return command + (f" --device {args.device}" if args.device != "cpu" else "")


def _ints(values: list[int]) -> str:
    return " ".join(map(str, values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--hot", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N; fp32 either way")
    parser.add_argument("--model", default=MODEL, help="registered name or a path to the same GGUF file")
    parser.add_argument(
        "--text-file", type=Path, default=DEVIL_DICT, help="devil.dict.dz, devil.index beside it"
    )
    parser.add_argument("--commit", default=None, help="commit to report where the tree has no git")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Full fp32 on CUDA too, so the figures compare with the CPU's: no TF32 in matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = LLMEngine.load(
        args.model,
        device=args.device,
        dtype="float32",
        max_batch_size=1,
        max_seq_len=max(args.contexts),  # the last token is only a target, never fed
        progress=False,
    )
    device = engine.runner.model.embed_tokens.weight.device
    ids = engine.tokenizer.encode(load_text(args.text_file)[: 8 * max(args.contexts)])  # ~4 chars a token
    rows: list[Row] = []
    for context in args.contexts:
        if context > len(ids):
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than the context {context}")
        reference: torch.Tensor | None = None
        for setting in settings(args.hot, args.groups):
            row, logprobs = measure(engine.runner.model, ids[:context], setting, reference, args.chunk)
            reference = logprobs if reference is None else reference
            rows.append(row)
            print(
                f"{row.context:>6} {row.setting:<36} ppl {row.perplexity:8.3f} KL {row.mean_kl:.5f} "
                f"p99 {row.p99_kl:.4f} {row.kv_bytes_per_token_bf16:>8,.0f} B/tok {row.seconds:6.1f} s",
                flush=True,
            )
    markdown = to_markdown(rows, environment(device, args.commit), args, len(ids))
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")
    print(markdown)


if __name__ == "__main__":
    main()
