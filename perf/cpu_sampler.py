"""Where the machine's CPU time goes while a benchmark runs: the busiest threads, once a second.

    python3 perf/cpu_sampler.py --out cpu.txt &   # ... run the benchmark ..., then kill it

Reads /proc only (the device machine has no ps or top). Each line: the time, the machine's busy
CPUs over the last interval (of its online CPUs), then the busiest threads as
`pid/tid:name@cpu cpu%` (100% = one CPU; @cpu the processor it last ran on), so that a thread
near 100% (a Python thread that is the bottleneck) or a machine near its CPU count stands out.
Written first: the cgroup's CPU quota, if any (a container can have fewer CPUs to use than it
sees), the NUMA nodes' CPUs and each NVIDIA GPU's node and local CPUs (a launch-bound thread on
the far node pays for every launch).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def thread_times() -> dict[str, tuple[str, int, str]]:
    """'pid/tid' -> (name, utime + stime ticks, last CPU) for every thread on the machine."""
    out: dict[str, tuple[str, int, str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            # fields[0] is stat's field 3 (state): utime 14, stime 15, processor 39
            out[f"{pid}/{tid}"] = (name, int(fields[11]) + int(fields[12]), fields[36])
    return out


def busy_ticks() -> int:
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    idle = int(cpu[3]) + int(cpu[4])  # idle + iowait
    return sum(int(x) for x in cpu[:8]) - idle


def quota() -> str:
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            return f"{path}: {Path(path).read_text().strip()}"
        except OSError:
            continue
    return "no cgroup CPU quota file"


def topology() -> list[str]:
    """The NUMA nodes' CPU lists, and each NVIDIA GPU's node and local CPUs (from sysfs)."""
    lines = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            lines.append(f"{node.name} cpus {(node / 'cpulist').read_text().strip()}")
        except OSError:
            continue
    for bus, node, local in nvidia_gpus():
        lines.append(f"gpu {bus} numa_node {node} local cpus {local}")
    return lines


def nvidia_gpus() -> list[tuple[str, str, str]]:
    """(PCI bus id, NUMA node, local CPU list) of each NVIDIA display / 3D controller in sysfs."""
    gpus = []
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            if (dev / "vendor").read_text().strip() != "0x10de":
                continue
            if not (dev / "class").read_text().startswith("0x03"):
                continue
            node = (dev / "numa_node").read_text().strip()
            local = (dev / "local_cpulist").read_text().strip()
        except OSError:
            continue
        gpus.append((dev.name, node, local))
    return gpus


def parse_cpulist(text: str) -> set[int]:
    """sysfs's "0-7,16-23" as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus() -> str | None:
    """The first NVIDIA GPU's local CPUs as sysfs lists them, None without one."""
    gpus = nvidia_gpus()
    return gpus[0][2] if gpus else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=8, help="threads per line")
    args = ap.parse_args()
    with args.out.open("w", buffering=1) as f:
        f.write(f"online CPUs {os.cpu_count()}; {quota()}\n")
        for line in topology():
            f.write(line + "\n")
        before, busy0, t0 = thread_times(), busy_ticks(), time.monotonic()
        while True:
            time.sleep(args.interval)
            now, busy1, t1 = thread_times(), busy_ticks(), time.monotonic()
            span = (t1 - t0) * TICKS
            rows = []
            for key, (name, ticks, cpu) in now.items():
                used = ticks - before.get(key, (name, ticks, cpu))[1]
                if used > 0:
                    rows.append((100.0 * used / span, f"{key}:{name}@{cpu}"))
            rows.sort(reverse=True)
            top = " ".join(f"{who} {pct:.0f}%" for pct, who in rows[: args.top])
            f.write(f"{time.strftime('%T')} busy {(busy1 - busy0) / span:.1f} CPUs | {top}\n")
            before, busy0, t0 = now, busy1, t1


if __name__ == "__main__":
    main()
