"""Concurrency sweep with perf_analyzer against the running `llm` model: `make sweep`.

    make perf-deps                              # once: installs .venv/bin/perf_analyzer
    .venv/bin/python perf/sweep.py --concurrency 1:8:1 --requests 32 --max-tokens 64

perf_analyzer runs once per concurrency value over gRPC streaming with `--request-count`
(exactly that many requests are measured, no stability windows) and `--profile-export-file`,
which records the send time of every request and the arrival time of each streamed response.
From those timestamps this script computes, per concurrency:

- output tok/s: requests x max_tokens over the span from the first send to the last response
  (every request asks for exactly max_tokens: min_tokens = max_tokens and ignore_eos);
- TTFT: first response - send;
- inter-token latency (ITL): (last response - first response) / (max_tokens - 1), one value per
  request, as genai-perf defines it (a response may carry more than one token);
- end-to-end latency: last response - send.

It writes `<out-dir>/sweep.csv` (one row per concurrency, p50/p99 of each latency),
`<out-dir>/sweep.png` (the three figures against concurrency) and perf_analyzer's own files per
concurrency under `<out-dir>/sweep/`.

Settings default to environment variables of the same upper-case name (URL, MODEL, CONCURRENCY,
REQUESTS, MAX_TOKENS, PROMPT_WORDS), so `CONCURRENCY=1:4:1 perf/perf_analyzer_sweep.sh` works.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a model token stream server latency batch cache prefix kernel decode".split()
EXPORT_ATTEMPTS = 3  # perf_analyzer runs per concurrency when its profile export comes back empty


@dataclass(frozen=True)
class SweepRow:
    """The figures for one concurrency value (latencies in milliseconds)."""

    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    requests_per_s: float
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float


CSV_FIELDS = [f.name for f in dataclasses.fields(SweepRow)]


def parse_range(spec: str) -> list[int]:
    """`start[:end[:step]]`, end inclusive, as perf_analyzer's `--concurrency-range` reads it."""
    parts = [int(p) for p in spec.split(":")]
    if not 1 <= len(parts) <= 3 or any(p < 1 for p in parts):
        raise ValueError(f"concurrency range {spec!r}: expected start:end:step, positive integers")
    start = parts[0]
    end = parts[1] if len(parts) > 1 else start
    step = parts[2] if len(parts) > 2 else 1
    if end < start:
        raise ValueError(f"concurrency range {spec!r}: end is below start")
    return list(range(start, end + 1, step))


def input_data(
    num_prompts: int, max_tokens: int, prompt_words: int, seed: int | None = None
) -> dict[str, Any]:
    """perf_analyzer's `--input-data` JSON: vllm_backend-style requests of exactly max_tokens.

    NOTE: each perf_analyzer run starts again at the first entry, and the server's prefix cache
    outlives runs; so every run gets fresh random prompts (seed None), one per request, or the
    prefix cache would turn later points' prefills into cache hits and flatter their TTFT.
    """
    rng = random.Random(seed)
    params = json.dumps({"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True})
    data = []
    for _ in range(num_prompts):
        prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        data.append(
            {
                "text_input": [prompt],
                "stream": [True],
                "exclude_input_in_output": [True],
                "sampling_parameters": [params],
            }
        )
    return {"data": data}


def summarize(export: dict[str, Any], max_tokens: int) -> list[SweepRow]:
    """One row per experiment of a perf_analyzer profile export (timestamps in ns)."""
    rows = []
    for experiment in export["experiments"]:
        concurrency = int(experiment["experiment"]["value"])
        sends, firsts, lasts = [], [], []
        for request in experiment["requests"]:
            stamps = request["response_timestamps"]
            if not stamps:
                continue  # no response at all: perf_analyzer itself reports the error
            sends.append(request["timestamp"])
            firsts.append(min(stamps))
            lasts.append(max(stamps))
        if not sends:
            raise ValueError(f"concurrency {concurrency}: no request received a response")
        send = np.array(sends, dtype=np.float64)
        first = np.array(firsts, dtype=np.float64)
        last = np.array(lasts, dtype=np.float64)
        ttft_ms = (first - send) / 1e6
        latency_ms = (last - send) / 1e6
        itl_ms = (last - first) / 1e6 / max(max_tokens - 1, 1)
        duration_s = (last.max() - send.min()) / 1e9
        n = len(sends)
        rows.append(
            SweepRow(
                concurrency=concurrency,
                requests=n,
                output_tokens=n * max_tokens,
                duration_s=round(duration_s, 3),
                requests_per_s=round(n / duration_s, 3),
                output_tok_per_s=round(n * max_tokens / duration_s, 2),
                ttft_p50_ms=_pct(ttft_ms, 50),
                ttft_p99_ms=_pct(ttft_ms, 99),
                itl_p50_ms=_pct(itl_ms, 50),
                itl_p99_ms=_pct(itl_ms, 99),
                latency_p50_ms=_pct(latency_ms, 50),
                latency_p99_ms=_pct(latency_ms, 99),
            )
        )
    return rows


def _pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def write_csv(rows: Sequence[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))


def plot(rows: Sequence[SweepRow], path: Path, title: str) -> None:
    """Output tok/s, TTFT and ITL (p50 solid, p99 dashed) against concurrency, side by side."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    x = [r.concurrency for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    axes[0].plot(x, [r.output_tok_per_s for r in rows], "o-")
    axes[0].set_ylabel("output tokens/s")
    for ax, name, label in (
        (axes[1], "ttft", "time to first token (ms)"),
        (axes[2], "itl", "inter-token latency (ms)"),
    ):
        ax.plot(x, [getattr(r, f"{name}_p50_ms") for r in rows], "o-", label="p50")
        ax.plot(x, [getattr(r, f"{name}_p99_ms") for r in rows], "s--", label="p99")
        ax.set_ylabel(label)
        ax.legend()
    for ax in axes:
        ax.set_xlabel("concurrency")
        ax.set_xticks(x)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def find_perf_analyzer(given: str | None) -> str:
    for candidate in (given, str(REPO_ROOT / ".venv" / "bin" / "perf_analyzer")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("perf_analyzer")
    if on_path:
        return on_path
    raise FileNotFoundError("perf_analyzer not found: run `make perf-deps`")


def run_one(
    perf_analyzer: str,
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    prompt_words: int,
    raw_dir: Path,
) -> dict[str, Any]:
    """perf_analyzer at one concurrency; returns its profile export."""
    count = max(requests, concurrency)
    input_path = raw_dir / f"input_c{concurrency}.json"
    # perf_analyzer may start a few requests past the count before it stops: a margin of prompts.
    input_path.write_text(json.dumps(input_data(count + concurrency, max_tokens, prompt_words)))
    export = raw_dir / f"profile_c{concurrency}.json"
    log = raw_dir / f"perf_analyzer_c{concurrency}.log"
    # NOTE: no --warmup-request-count: perf_analyzer 2.51 hangs with it at concurrency 2.
    cmd = [
        perf_analyzer,
        *("-m", model, "-u", url, "-i", "grpc", "--streaming"),
        *("--input-data", str(input_path)),
        *("--concurrency-range", str(concurrency)),
        *("--request-count", str(count)),
        *("-f", str(raw_dir / f"perf_analyzer_c{concurrency}.csv")),
        *("--profile-export-file", str(export)),
    ]
    # NOTE: perf_analyzer 2.51 now and then exits 0 with an empty profile export (seen once in
    # a CI run at concurrency 1 with every request answered): such a run is made again.
    for _attempt in range(EXPORT_ATTEMPTS):
        export.unlink(missing_ok=True)
        with open(log, "wb") as out:
            code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
        if code != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"perf_analyzer exited {code} at concurrency {concurrency}:\n{tail}")
        if export.is_file() and export.stat().st_size:
            return dict(json.loads(export.read_text()))
    raise RuntimeError(
        f"perf_analyzer wrote no profile export at concurrency {concurrency} "
        f"({EXPORT_ATTEMPTS} runs); its log: {log}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", default=env("URL", "localhost:8001"), help="gRPC host:port")
    parser.add_argument("--model", default=env("MODEL", "llm"))
    parser.add_argument(
        "--concurrency", default=env("CONCURRENCY", "1:8:1"), help="start:end:step, end included"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=int(env("REQUESTS", "32")),
        help="requests measured per concurrency",
    )
    parser.add_argument("--max-tokens", type=int, default=int(env("MAX_TOKENS", "64")))
    parser.add_argument("--prompt-words", type=int, default=int(env("PROMPT_WORDS", "128")))
    parser.add_argument("--out-dir", type=Path, default=Path(env("OUT_DIR", "perf/results")))
    parser.add_argument("--perf-analyzer", default=env("PERF_ANALYZER"))
    args = parser.parse_args(argv)

    concurrencies = parse_range(args.concurrency)
    url = args.url.split("://", 1)[-1]  # perf_analyzer takes host:port
    perf_analyzer = find_perf_analyzer(args.perf_analyzer)
    raw_dir = args.out_dir / "sweep"
    raw_dir.mkdir(parents=True, exist_ok=True)

    print(
        f"sweep: {perf_analyzer} -> {url} model={args.model} concurrency={concurrencies} "
        f"requests={args.requests} max_tokens={args.max_tokens} prompt_words={args.prompt_words}",
        flush=True,
    )
    rows: list[SweepRow] = []
    for c in concurrencies:
        export = run_one(
            perf_analyzer,
            url,
            args.model,
            c,
            args.requests,
            args.max_tokens,
            args.prompt_words,
            raw_dir,
        )
        rows.extend(summarize(export, args.max_tokens))
        r = rows[-1]
        print(
            f"  concurrency {c:3d}: {r.output_tok_per_s:9.1f} tok/s  TTFT p50 {r.ttft_p50_ms:8.1f} "
            f"p99 {r.ttft_p99_ms:8.1f} ms  ITL p50 {r.itl_p50_ms:7.2f} p99 {r.itl_p99_ms:7.2f} ms",
            flush=True,
        )

    csv_path, png_path = args.out_dir / "sweep.csv", args.out_dir / "sweep.png"
    write_csv(rows, csv_path)
    title = (
        f"{args.model} over gRPC streaming: {args.prompt_words}-word prompts, "
        f"{args.max_tokens} output tokens, {args.requests} requests per point"
    )
    plot(rows, png_path, title)
    print(f"results: {csv_path} {png_path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
