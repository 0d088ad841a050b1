"""Streaming load at fixed concurrency, through tritonserver (gRPC) and through the engine directly.

    .venv/bin/python perf/serve_bench.py --target server --url localhost:8001 \\
        --concurrency 1,16,64 --prompt-tokens 512 --max-tokens 256 --out server.json
    .venv/bin/python perf/serve_bench.py --target engine --concurrency 1,16,64 ... --out direct.json

Per concurrency value C, C workers each send `--requests-per-worker` requests one after another
(so C requests are in flight at a time; more where `--min-requests` asks for more at a low C),
after one warm-up request. Every request has the same
prompt length (random single-token words, checked with the model's tokenizer) and asks for
exactly `max_tokens` (min_tokens = max_tokens, ignore_eos, greedy), as in perf/sweep.py.

- `server`: tritonclient.grpc, one client and bidirectional stream per worker, to the `llm`
  model (vllm_backend-style inputs, as client/stream_client.py sends them).
- `engine`: the same prompts through `AsyncEngine` in this process, configured as the server's
  model is (model_repository/llm/1/model.json plus LLM_<FIELD> variables), so the two runs can
  be divided. Run it when no server holds the GPU.
- `engine_process`: the same through `EngineProcess` (the engine in a child process, as the
  Triton model runs it by default), without Triton: what the process boundary costs on its own.

Both time a request's tokens by their arrival, whether or not they decode to text (the server is
asked for `num_output_tokens` in every response). Figures per concurrency (latencies in ms):
output tok/s (requests x max_tokens over the span from the first send to the last token), TTFT
p50/p99 (first token - send), inter-token latency p50/p99 ((last - first token) /
(max_tokens - 1), one value per request), end-to-end p50/p99. JSON on stdout and in `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import random
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_TOKENIZER = REPO / "models" / "smollm2-135m-instruct"
REQUEST_TIMEOUT_S = 300.0
MODEL_JSON = REPO / "model_repository" / "llm" / "1" / "model.json"


@dataclass
class Timing:
    """One request: seconds on one monotonic clock."""

    sent: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    error: str | None = None
    queue: float | None = None  # the engine's own stages (engine targets: RequestMetrics)
    prefill: float | None = None


def single_token_words(tokenizer: Any, limit: int = 2000) -> list[str]:
    """Lower-case alphabetic words that are one token with a leading space."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if not token.startswith("\u0120"):  # the byte-level BPE space marker
            continue
        word = token[1:]
        if word.isalpha() and word.islower() and 2 <= len(word) <= 8:
            if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
                words.append(word)
        if len(words) >= limit:
            break
    return words


WARM_SEED = 1 << 40  # the warm-up's prompt seeds start here, far from the levels' (args.seed up)


def prompt_seeds(
    levels: list[int], per_worker: int, min_requests: int, seed: int
) -> tuple[list[int], list[list[int]]]:
    """Prompt seeds of the warm-up (the largest level once) and of each level's requests, all
    different. NOTE: random.Random(-k) is random.Random(k): the warm-up once drew its seeds
    below zero, so its prompts were the levels' and their first requests hit the prefix cache."""
    warm = [WARM_SEED + i for i in range(max(levels))]
    out, k = [], seed
    for c in levels:
        n = c * max(per_worker, -(-min_requests // c))
        out.append(list(range(k + 1, k + 1 + n)))
        k += n + 1
    return warm, out


def make_prompt(tokenizer: Any, words: list[str], n_tokens: int, seed: int) -> str:
    """Random words whose text tokenizes to exactly `n_tokens` (without special tokens)."""
    rng = random.Random(seed)
    text = "".join(" " + rng.choice(words) for _ in range(n_tokens)).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != n_tokens:  # merges across words are rare; cut or pad by decoding ids
        ids = (ids + ids)[:n_tokens]
        text = tokenizer.decode(ids)
    return text


def params(max_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }


# ---- through tritonserver ---------------------------------------------------------------------


def grpc_worker(
    url: str, model: str, prompts: list[str], max_tokens: int, out: list[Timing]
) -> None:
    """Send `prompts` one after another on one stream, recording each one's timing."""
    import tritonclient.grpc as grpcclient

    from client.stream_client import build_inputs, grpc_inputs

    events: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: events.put((time.perf_counter(), result, error))
    )
    try:
        for prompt in prompts:
            # num_output_tokens in every response: the first token is timed when it arrives,
            # as engine-direct times it, not when the first non-empty text does (a random
            # checkpoint's ids beyond the tokenizer's vocabulary decode to nothing)
            fields = build_inputs(prompt, params(max_tokens)) | {"return_num_output_tokens": True}
            inputs = grpc_inputs(fields)
            t = Timing(sent=time.perf_counter())
            client.async_stream_infer(
                model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
            while True:
                try:
                    now, result, error = events.get(timeout=REQUEST_TIMEOUT_S)
                except queue.Empty:
                    t.error = f"no response for {REQUEST_TIMEOUT_S} s"
                    break
                if error is not None:
                    t.error = str(error)
                    break
                tokens = result.as_numpy("num_output_tokens")
                if tokens is not None and tokens.size and tokens.reshape(-1)[0] > 0:
                    t.first = t.first if t.first is not None else now
                    t.last = now
                    t.chunks += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            out.append(t)
    finally:
        client.stop_stream()
        client.close()


def run_server_level(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Timing], float, float]:
    per = len(prompts) // concurrency
    results: list[list[Timing]] = [[] for _ in range(concurrency)]
    threads = [
        threading.Thread(
            target=grpc_worker,
            args=(url, model, prompts[i * per : (i + 1) * per], max_tokens, results[i]),
        )
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    timings = [t for r in results for t in r]
    return timings, start, time.perf_counter()


# ---- through the engine, in this process ------------------------------------------------------


def make_engine(target: str) -> Any:
    from engine.async_engine import AsyncEngine
    from engine.config import load_engine_config
    from engine.engine_process import EngineProcess

    config = load_engine_config(MODEL_JSON, REPO, os.environ)
    return EngineProcess(config) if target == "engine_process" else AsyncEngine(config)


async def stream(engine: Any, prompt: str, sp: Any) -> AsyncIterator[Any]:
    """A request's deltas through `add_request` and its callback, which `AsyncEngine` and
    `EngineProcess` share (the callback runs on their own thread)."""
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[Any] = asyncio.Queue()
    engine.add_request(
        uuid.uuid4().hex, prompt, sp, lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d)
    )
    while True:
        delta = await deltas.get()
        yield delta
        if delta.finished:
            return


def run_engine_level(
    engine: Any, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Timing], float, float]:
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(**params(max_tokens))
    per = len(prompts) // concurrency

    async def one(prompt: str) -> Timing:
        t = Timing(sent=time.perf_counter())
        async for delta in stream(engine, prompt, sp):
            now = time.perf_counter()
            if delta.error:
                t.error = delta.error
            if delta.token_ids:
                t.first = t.first if t.first is not None else now
                t.last = now
                t.chunks += 1
            if delta.metrics is not None:
                t.queue, t.prefill = delta.metrics.queue_time, delta.metrics.prefill_time
        return t

    async def worker(chunk: list[str]) -> list[Timing]:
        return [await one(p) for p in chunk]

    async def level() -> list[list[Timing]]:
        chunks = [prompts[i * per : (i + 1) * per] for i in range(concurrency)]
        return await asyncio.gather(*(worker(c) for c in chunks))

    start = time.perf_counter()
    results = asyncio.run(level())
    return [t for r in results for t in r], start, time.perf_counter()


# row field -> the server's histogram whose per-level mean it reports (--metrics-url)
SERVER_MEANS = {
    "stub_ttft_mean_ms": "llm_time_to_first_token_seconds",  # execute() to the first delta
    "engine_queue_mean_ms": "llm_request_queue_time_seconds",
    "engine_prefill_mean_ms": "llm_request_prefill_time_seconds",
}


def histogram_totals(metrics_url: str | None) -> dict[str, tuple[float, int]]:
    """(sum, count) of each SERVER_MEANS histogram on the server's metrics page ({}: no URL)."""
    if not metrics_url:
        return {}
    import urllib.request

    totals = {name: [0.0, 0] for name in SERVER_MEANS.values()}
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)  # name{labels} value
            base, _, kind = key.partition("{")[0].rpartition("_")
            if base in totals and kind in ("sum", "count"):
                totals[base][kind == "count"] += float(value)
    return {name: (total, int(count)) for name, (total, count) in totals.items()}


def settled_totals(
    metrics_url: str | None,
    before: dict[str, tuple[float, int]],
    requests: int,
    timeout_s: float = 3.0,
) -> dict[str, tuple[float, int]]:
    """`histogram_totals` once every SERVER_MEANS histogram has `requests` more observations
    than `before` (or after `timeout_s`). The model publishes a finished request's histograms
    from its metrics thread after the client has its last response, one observation at a
    time, so a page read at once can hold a level's TTFT without its engine stages."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = histogram_totals(metrics_url)
        done = all(
            after.get(m, (0.0, 0))[1] - before.get(m, (0.0, 0))[1] >= requests
            for m in SERVER_MEANS.values()
        )
        if done or not after or time.monotonic() >= deadline:
            return after
        time.sleep(0.05)


def level_means(
    before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]
) -> dict[str, float]:
    """Per-level means in ms of the histograms that got observations between the two reads."""
    means = {}
    for field_name, metric in SERVER_MEANS.items():
        if metric in before and metric in after:
            (s0, c0), (s1, c1) = before[metric], after[metric]
            if c1 > c0:
                means[field_name] = round(1e3 * (s1 - s0) / (c1 - c0), 3)
    return means


def engine_means(timings: list[Timing]) -> dict[str, float]:
    """Engine targets: mean queue and prefill time in ms from the engine's RequestMetrics."""
    means = {}
    for field_name, values in (
        ("engine_queue_mean_ms", [t.queue for t in timings if t.queue is not None]),
        ("engine_prefill_mean_ms", [t.prefill for t in timings if t.prefill is not None]),
    ):
        if values:
            means[field_name] = round(1e3 * float(np.mean(values)), 3)
    return means


# ---- figures ----------------------------------------------------------------------------------


def summarize(
    timings: list[Timing], start: float, end: float, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None and t.first is not None and t.last is not None]
    errors = [t.error for t in timings if t.error is not None]
    span = (max(t.last for t in ok) - start) if ok else end - start  # type: ignore[type-var,operator]
    ttft = np.array([(t.first - t.sent) * 1e3 for t in ok])  # type: ignore[operator]
    itl = np.array([(t.last - t.first) * 1e3 / max(max_tokens - 1, 1) for t in ok])  # type: ignore[operator]
    e2e = np.array([(t.last - t.sent) * 1e3 for t in ok])  # type: ignore[operator]

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 3) if a.size else None

    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": len(ok) * max_tokens,
        "duration_s": round(span, 4),
        "output_tok_per_s": round(len(ok) * max_tokens / span, 2) if span > 0 else None,
        "ttft_mean_ms": round(float(ttft.mean()), 3) if ttft.size else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p99_ms": pct(e2e, 99),
        "chunks_per_request": round(float(np.mean([t.chunks for t in ok])), 2) if ok else None,
        **engine_means(ok),
        # every request's TTFT (a mean and a p50 of 32 requests can hide two modes), and
        # the engine's own prefill time per request where the target reports it
        "ttft_ms": [round(float(x), 3) for x in ttft],
        "engine_prefill_ms": [round(1e3 * t.prefill, 3) for t in ok if t.prefill is not None],
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    words = single_token_words(tokenizer)
    levels = [int(c) for c in str(args.concurrency).split(",") if c]
    engine = make_engine(args.target) if args.target != "server" else None
    run: Callable[[list[str], int, int], tuple[list[Timing], float, float]]
    if engine is not None:

        def run(prompts: list[str], c: int, max_tokens: int) -> tuple[list[Timing], float, float]:
            return run_engine_level(engine, prompts, c, max_tokens)
    else:

        def run(prompts: list[str], c: int, max_tokens: int) -> tuple[list[Timing], float, float]:
            return run_server_level(args.url, args.model, prompts, c, max_tokens)

    rows = []
    try:
        # Kernel compilation (the prefill shapes of the largest level too), graph capture and
        # connection set-up out of the figures: the largest level once, with a few tokens each.
        warm_seeds, level_seeds = prompt_seeds(
            levels, args.requests_per_worker, args.min_requests, args.seed
        )
        warm = [make_prompt(tokenizer, words, args.prompt_tokens, k) for k in warm_seeds]
        run(warm, max(levels), min(4, args.max_tokens))
        for c, seeds in zip(levels, level_seeds, strict=True):
            # distinct prompts: no prefix-cache hits between requests of a level or across them
            prompts = [make_prompt(tokenizer, words, args.prompt_tokens, k) for k in seeds]
            before = histogram_totals(args.metrics_url)
            timings, start, end = run(prompts, c, args.max_tokens)
            row = summarize(timings, start, end, c, args.max_tokens)
            after = settled_totals(args.metrics_url, before, len(prompts))
            row.update(level_means(before, after))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        if engine is not None:
            engine.shutdown()
    return {
        "target": args.target,
        "url": args.url if engine is None else None,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests_per_worker": args.requests_per_worker,
        "min_requests": args.min_requests,
        "env": {k: v for k, v in os.environ.items() if k.startswith("LLM_")},
        "rows": rows,
    }


def write_sweep(res: dict[str, Any], out_dir: Path) -> None:
    """The rows as perf/sweep.py's sweep.csv and sweep.png (output tok/s, TTFT, ITL against
    concurrency)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sweep import SweepRow, plot, write_csv

    rows = [
        SweepRow(
            concurrency=r["concurrency"],
            requests=r["requests"],
            output_tokens=r["output_tokens"],
            duration_s=r["duration_s"],
            requests_per_s=round(r["requests"] / r["duration_s"], 3),
            output_tok_per_s=r["output_tok_per_s"],
            ttft_p50_ms=r["ttft_p50_ms"],
            ttft_p99_ms=r["ttft_p99_ms"],
            itl_p50_ms=r["itl_p50_ms"],
            itl_p99_ms=r["itl_p99_ms"],
            latency_p50_ms=r["e2e_p50_ms"],
            latency_p99_ms=r.get("e2e_p99_ms", r["e2e_p50_ms"]),
        )
        for r in res["rows"]
        if not r["errors"]
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "sweep.csv")
    where = "tritonserver, gRPC streaming" if res["target"] == "server" else "AsyncEngine"
    title = (
        f"{where}: {res['prompt_tokens']}-token prompts, {res['max_tokens']} output tokens, "
        f"{res['requests_per_worker']} requests per worker"
    )
    plot(rows, out_dir / "sweep.png", title)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=("server", "engine", "engine_process"), default="server")
    ap.add_argument("--url", default="localhost:8001", help="gRPC host:port (server target)")
    ap.add_argument("--model", default="llm")
    ap.add_argument(
        "--metrics-url",
        default=None,
        help="server target: the server's metrics URL; adds the model's own mean TTFT per level",
    )
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-worker", type=int, default=2)
    ap.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="at least this many requests per level (more per worker at a low concurrency)",
    )
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--sweep-dir",
        type=Path,
        default=None,
        help="also write sweep.csv and sweep.png there, as `make sweep` does (perf/sweep.py)",
    )
    ap.add_argument(
        "--from-json", type=Path, default=None, help="plot an earlier --out file, run nothing"
    )
    args = ap.parse_args(argv)
    if args.target != "server":  # the engine's batch log (decode_log_interval) on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = json.loads(args.from_json.read_text()) if args.from_json else bench(args)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out and not args.from_json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.sweep_dir:
        write_sweep(res, args.sweep_dir)
    bad = sum(r["errors"] for r in res["rows"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
