"""bench/arrival_gpu.py's scenario on vLLM, the reference to run beside it in the same lease: streams
decode, one long prompt arrives; the longest time one stream waits for a token, the arrival's TTFT.

    PYTHONPATH=/tmp/site python3 bench/arrival_vllm.py --streams 16 --prompt 32768 --out $OUT

vLLM comes from ../shared/tools/vllm-h200 (never a dependency of this project). Llama-3.1-8B shape with
dummy weights, greedy, EOS ignored, prefix caching off, `--max-num-batched-tokens` (default 4096, the
chunk our engine takes). Steps are driven by hand through `LLM.llm_engine` and timed on the host.
Prints one JSON line per run and appends it to $OUT/arrival_vllm.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

for key, value in {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # steps in this process, so the host timing is the step's
}.items():
    os.environ.setdefault(key, value)

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-prompt", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=32_768)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    import vllm
    from vllm import LLM, SamplingParams

    model = Path("/tmp/vllm_models/8B")
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
    llm = LLM(
        model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=args.prompt + 256, gpu_memory_utilization=0.90, enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(64, args.streams + 1), seed=0,
    )  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    counter = iter(range(1 << 30))

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)

    def add(length: int, max_tokens: int) -> str:
        request_id = f"r{next(counter)}"
        ids = [rng.randrange(10, 128000) for _ in range(length)]
        engine.add_request(request_id, {"prompt_token_ids": ids}, params(max_tokens))
        return request_id

    def run(prompt: int) -> dict:
        streams = [add(args.stream_prompt, 100_000) for _ in range(args.streams)]
        counts: dict[str, int] = {}

        def step() -> None:
            for output in engine.step():
                counts[output.request_id] = len(output.outputs[0].token_ids)

        while any(counts.get(r, 0) < 1 for r in streams):
            step()
        steady = []
        for _ in range(16):
            before = time.perf_counter()
            step()
            steady.append((time.perf_counter() - before) * 1e3)
        watched = streams[0]
        arriving = add(prompt, 8)
        submitted = time.perf_counter()
        token_times, tokens = [submitted], counts[watched]
        first_token_s, tokens_during, steps = None, 0, 0
        while first_token_s is None or len(token_times) < tokens_during + 9:
            step()
            steps += 1
            now = time.perf_counter()
            if counts.get(watched, 0) > tokens:
                tokens = counts[watched]
                token_times.append(now)
            if first_token_s is None and counts.get(arriving, 0) >= 1:
                first_token_s = now - submitted
                tokens_during = len(token_times) - 1
        engine.abort_request([*streams, arriving])
        while engine.has_unfinished_requests():
            engine.step()
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(token_times)]
        assert first_token_s is not None
        return {
            "engine": f"vLLM {vllm.__version__}",
            "streams": args.streams,
            "stream_prompt": args.stream_prompt,
            "prompt": prompt,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "steady_ms": round(statistics.median(steady), 2),
            "ttft_ms": round(first_token_s * 1e3, 1),
            "longest_gap_ms": round(max(gaps), 1),
            "tokens_during": tokens_during,
            "steps": steps,
        }

    run(min(args.prompt, 2 * 4096 + 300))  # warm-up
    for _ in range(args.repeats):
        row = run(args.prompt)
        print(json.dumps(row), flush=True)
        with (args.out / "arrival_vllm.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
