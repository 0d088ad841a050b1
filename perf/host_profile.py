"""Host work of the engine loop, per decode step, on CPU: where the time goes that the overlap
schedule must hide behind the GPU's step (scheduling, input building, output processing).

    .venv/bin/python perf/host_profile.py [--requests 256] [--max-tokens 32]

Builds a small random Llama checkpoint (engine.tools.make_random_checkpoint, SmolLM2's
tokenizer), runs `--requests` requests of 64 random prompt tokens through `LLM.generate` under
cProfile and prints, per engine step, the cumulative seconds of the host-side functions. The
model's own forward is excluded (on a GPU it runs on the device).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = {
    "output processing (detokenize, stops, callbacks)": ("engine_core.py", "_process"),
    "scheduling": ("scheduler.py", "schedule"),
    "input building": ("model_runner.py", "prepare"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "llama"
        tokenizer = ROOT / "models" / "smollm2-135m-instruct"
        subprocess.run(
            [sys.executable, "-m", "engine.tools.make_random_checkpoint", "--arch", "llama",
             "--out", str(ckpt), "--tokenizer", str(tokenizer)],
            check=True, capture_output=True, cwd=ROOT,
        )  # fmt: skip
        llm = LLM(
            str(ckpt),
            dtype="float32",
            max_total_tokens=200_000,
            max_running_requests=args.requests,
            chunked_prefill_size=8192,
            enable_overlap=True,
        )
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params)
        prof.disable()
        llm.shutdown()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def seconds(file: str, func: str) -> float:
        return sum(v[3] for (f, _, name), v in stats.items() if f.endswith(file) and name == func)

    steps = (
        sum(
            v[0]
            for (f, _, name), v in stats.items()
            if f.endswith("engine_core.py") and name == "step"
        )
        or 1
    )
    tokens = args.requests * args.max_tokens
    print(f"{args.requests} requests x {args.max_tokens} tokens, {steps} engine steps (cProfile)")
    for label, (file, func) in PARTS.items():
        total = seconds(file, func)
        print(f"  {label}: {total:.3f} s, {1e6 * total / tokens:.1f} us per generated token")


if __name__ == "__main__":
    main()
