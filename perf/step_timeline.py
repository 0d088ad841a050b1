"""Where one profiled decode step's time goes, kernel by kernel, from a bench_engine JSON.

bench_engine's profiles keep one step's kernels in launch order (`step_timeline`: name, us,
idle gap before it). This groups them by kernel name: launches per step, median duration,
median gap, and the step time they account for (durations plus the gaps before them), largest
first.

    python3 perf/step_timeline.py /tmp/bench_engine.json [--top 25]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def profiles(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every dict holding a `step_timeline`, with where it sits in the JSON."""
    if isinstance(node, dict):
        if "step_timeline" in node:
            yield path or "/", node
        for key, value in node.items():
            yield from profiles(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from profiles(value, f"{path}/{i}")


def table(timeline: list[list[Any]], top: int) -> list[str]:
    by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name, us, gap in timeline:
        by_name[name].append((float(us), float(gap)))
    rows = sorted(by_name.items(), key=lambda kv: -sum(d + g for d, g in kv[1]))
    total = sum(float(us) + float(gap) for _, us, gap in timeline)
    lines = [
        f"{len(timeline)} kernels, {total:.1f} us (durations + gaps)",
        f"{'kernel':<60} {'n':>4} {'med us':>7} {'med gap':>7} {'total us':>9}",
    ]
    for name, items in rows[:top]:
        durs, gaps = [d for d, _ in items], [g for _, g in items]
        lines.append(
            f"{name[:60]:<60} {len(items):>4} {statistics.median(durs):>7.2f} "
            f"{statistics.median(gaps):>7.2f} {sum(durs) + sum(gaps):>9.1f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    found = False
    for where, prof in profiles(json.loads(args.json.read_text())):
        if prof["step_timeline"]:
            found = True
            print(f"== {where} (batch sizes {prof.get('batch_sizes')})")
            print("\n".join(table(prof["step_timeline"], args.top)))
    if not found:
        raise SystemExit(f"{args.json}: no profiled step (bench_engine --profile-ns)")


if __name__ == "__main__":
    main()
