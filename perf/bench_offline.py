"""Offline throughput: our engine with N concurrent requests vs transformers one request at a time.

Both run the same prompts with greedy decoding and a fixed number of new tokens (ignore EOS), on
the same device, in the same process, so the ratio is a like-for-like comparison. On a GPU the
engine also runs a second time with CUDA graphs off (its eager path), for their ratio.

    .venv/bin/python perf/bench_offline.py --model models/smollm2-135m-instruct --requests 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

TOPICS = [
    "the history of the printing press",
    "how photosynthesis works",
    "why the sky is blue",
    "the rules of chess",
    "how a compiler turns code into machine instructions",
    "the water cycle",
    "what a black hole is",
    "how vaccines train the immune system",
]


def make_prompts(tokenizer, n: int) -> list[str]:
    prompts = []
    for i in range(n):
        chat = [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} (part {i + 1})."}]
        prompts.append(
            tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        )
    return prompts


def run_engine(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Tokens per second of one `generate` over all prompts, after a short warm-up."""
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--page-size", type=int, default=1, help="the engine's KV page size")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    common = dict(device=args.device, max_total_tokens=16384, page_size=args.page_size)
    llm = LLM(args.model, **common)
    device, dtype = llm.core.runner.device, llm.core.runner.dtype
    prompts = make_prompts(llm.tokenizer, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ours_tok_s = run_engine(llm, prompts, params)
    graphs = llm.core.runner.graph_runner is not None
    tok = llm.tokenizer
    llm.shutdown()
    eager_tok_s = None
    if graphs:
        del llm
        torch.cuda.empty_cache()
        eager = LLM(args.model, enable_cuda_graph=False, **common)
        eager_tok_s = run_engine(eager, prompts, params)
        eager.shutdown()

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    hf_tokens = 0
    t0 = time.perf_counter()
    for prompt in tqdm(prompts, desc="transformers, one by one"):
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = hf.generate(
                ids,
                do_sample=False,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=tok.eos_token_id,
            )
        hf_tokens += out.shape[1] - ids.shape[1]
    hf_s = time.perf_counter() - t0

    result = {
        "device": str(device),
        "dtype": str(dtype),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "page_size": args.page_size,
        "cuda_graphs": graphs,
        "ours_tok_s": ours_tok_s,
        "ours_eager_tok_s": eager_tok_s,
        "transformers_tok_s": hf_tokens / hf_s,
        "ratio": ours_tok_s / (hf_tokens / hf_s),
    }
    eager_txt = (
        f"ours eager {eager_tok_s:.1f} tok/s ({ours_tok_s / eager_tok_s:.2f}x) | "
        if eager_tok_s
        else ""
    )
    print(
        f"| {args.requests} requests x {args.max_tokens} tokens | {device} {dtype} | "
        f"ours {ours_tok_s:.1f} tok/s{' (CUDA graphs)' if graphs else ''} | {eager_txt}"
        f"transformers sequential {result['transformers_tok_s']:.1f} tok/s | "
        f"ratio {result['ratio']:.2f}x |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
