"""The engine's decode at 128 query heads (DeepSeek-V2/V3 with one GPU for attention), with each
MLA decode kernel, in one process: what the kernel of 64 heads a program gives end to end.

A random checkpoint with DeepSeek-V2's attention shape (hidden 5120, 128 heads, q_lora_rank
1536, kv_lora_rank 512, 128 + 64 q/k head dims, v 128) and a dense MLP (V2's 12288) is written
once (`--layers` of them; transformers' own classes, bf16). For each kernel (`--kernels`,
EngineConfig.mla_decode_kernel), KV cache dtype (`--kv`, EngineConfig.kv_cache_dtype) and request
count N: N random prompts of `--prompt-len` tokens, then the decode phase alone, timed as a
`generate` of `--max-tokens` new tokens less one of a single new token over the same prompts
(radix cache off, so both prefill alike), with CUDA graphs. The ratio of each kernel's decode
tok/s to the first kernel's over the same cache is printed and written.

    python3 perf/bench_mla_heads.py --requests 16 64 --kv auto fp8_e4m3 --json /tmp/heads.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.tools.make_random_checkpoint import make_checkpoint

V2_ATTENTION = dict(
    hidden_size=5120, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, intermediate_size=12288, first_k_dense_replace=1000,
    max_position_embeddings=8192,
)  # fmt: skip


def decode_tok_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens per second: `max_tokens` new tokens less the first (prefill) one."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    t1 = time.perf_counter()
    llm.generate(prompts, full)
    t2 = time.perf_counter()
    return len(prompts) * (max_tokens - 1) / ((t2 - t1) - (t1 - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="/tmp/rand-v2-heads128", help="written if missing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kernels", nargs="+", default=["triton", "auto"])
    ap.add_argument("--kv", nargs="+", default=["auto"], help="kv_cache_dtype values")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    model = Path(args.model)
    if not (model / "config.json").is_file():
        make_checkpoint(
            model, layers=args.layers, weight_scale=0.02, save_dtype=torch.bfloat16,
            **V2_ATTENTION,  # type: ignore[arg-type]
        )  # fmt: skip
    rng = random.Random(0)
    longest = max(args.requests)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(longest)]
    context = args.prompt_len + args.max_tokens
    results: list[dict[str, Any]] = []
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"GPU: {gpu}  torch {torch.__version__}")
    for kv in args.kv:
        for kernel in args.kernels:
            llm = LLM(
                str(model), mla_decode_kernel=kernel, kv_cache_dtype=kv, disable_radix_cache=True,
                max_running_requests=longest, max_context_len=context,
                max_total_tokens=longest * context + 1024, cuda_graph_max_bs=longest,
            )  # fmt: skip
            gluon = bool(getattr(llm.core.runner.attn_backend, "gluon_decode", False))
            for n in args.requests:
                tok_s = decode_tok_s(llm, prompts[:n], args.max_tokens)
                row = {"kv": kv, "kernel": kernel, "gluon": gluon, "requests": n}
                results.append({**row, "decode_tok_s": tok_s})
                print(f"kv={kv} kernel={kernel} (gluon={gluon}) N={n}: {tok_s:.0f} tok/s")
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
    first = args.kernels[0]
    base = {(r["kv"], r["requests"]): r["decode_tok_s"] for r in results if r["kernel"] == first}
    for r in results:
        r["vs_first"] = r["decode_tok_s"] / base[r["kv"], r["requests"]]
        print(f"kv={r['kv']} {r['kernel']} N={r['requests']}: {r['vs_first']:.2f}x {first}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
