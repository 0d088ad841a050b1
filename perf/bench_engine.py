"""The engine on DeepSeek-V2-Lite's shape, phase by phase, against the GPU's ceilings (issue 12).

One run (under 8 minutes on one H200):
- writes the full V2-Lite shape with random bf16 weights (perf/write_v2lite_checkpoint.py), or
  reuses it, and measures the device-to-device copy bandwidth;
- batch-1 decode ms/step with CUDA graphs (the default), eagerly (enable_cuda_graph=False), and
  with graphs + torch.compile: an engine of its own per `--compile-layers` choice (graphs and
  compile up to batch 16), which also runs the `--compile-ns` request counts (default 16) and
  reports its start-up time, compilation included (a second run loads inductor's cache); it
  runs after the graphs-only engines, and `compile.<layers>.vs_graphs` gives graphs-alone time
  over compiled time from the same run (batch 1, and the decode phase of each shared N);
- for N requests (512 random prompt tokens, 256 new tokens, ignore_eos, greedy), with bf16 and
  with FP8 (e4m3) KV: end-to-end output tok/s; the decode phase alone (steps without prefill:
  ms/step, tok/s, share of the decode ceiling); the prefill phase alone (tok/s, TFLOP/s, share
  of the compute ceiling);
- the KV tokens that fit (runner.max_total_tokens at the default mem_fraction), bf16 and FP8;
- a torch.profiler summary of batch-1 and batch-16 decode steps (kernels, GPU time, wall time);
- per step, the host's busy time (a step's wall time less the time it waited for the device)
  and the device's time (CUDA events around the step); `--overlap-compare` adds batch-1 decode
  with the overlap schedule the other way round (`--overlap` sets it for every engine);
- `--fp8-absorb-compare` (issue 12 item 7): an engine with absorbed_weight_dtype="fp8_e4m3"
  (MLA's w_kc and w_vc in e4m3, bf16 KV, the default graphs), run after the bf16 engine:
  batch-1 decode and the `--fp8-absorb-ns` request counts (default 64), each beside the bf16
  engine's figure of the same N (its ceilings are the bf16 engine's: the e4m3 weights save
  27 x 2 MiB of the ~4.9 GB a batch-1 step reads, about 1%).

Phases are timed from outside the engine: `EngineCore.step` and `Scheduler.schedule` are wrapped
on the instances (classified by the batch's mode). Without overlap each step runs between two
synchronizations; with overlap a step processes the batch the step before it launched, so a
batch is timed from the return of the step that launched it to the return of the next one (no
synchronization: it would undo the overlap).

Decode ceiling of a step = bytes it must read / copy bandwidth: the expert weights its tokens
touch (expected distinct experts of b tokens each picking top_k of E uniformly:
E * (1 - (1 - top_k/E)^b)), the dense, shared-expert, router and attention weights, the LM head,
the embedding rows, and the KV rows of every context. Prefill ceiling = FLOPs / 790 TFLOP/s:
2 x the active parameters per token (embedding and LM head aside), the LM head of each sampled
row, and causal attention (QK and PV over every (query, key) pair of each head).

    python3 perf/bench_engine.py --json /tmp/bench_engine.json            # the full run (GPU)
    python3 perf/bench_engine.py --quick --ns 1,16                        # a shorter one
    python3 perf/bench_engine.py --kv bf16 --ns 1,64 --skip-compile --profile-ns "" \
        --fp8-absorb-compare                                              # FP8 absorbed weights
    python3 perf/bench_engine.py --kv fp8,bf16 --isolate ...              # a process per dtype
    python3 perf/bench_engine.py --kv fp8,bf16 --isolate --abba ...       # fp8, bf16, bf16, fp8
    python3 perf/bench_engine.py --kv bf16,fp8,fp8_triton --isolate ...   # + the Triton FP8 decode
    .venv/bin/python perf/bench_engine.py --tiny --quick --device cpu     # seconds, on CPU

On CPU "bf16" names the engine's default KV dtype (float32 there). Measurements that would end
after `--time-budget` seconds (counted from after the checkpoint write) are skipped and listed
(an FP8 measurement is expected to take as long as its bf16 counterpart did); the JSON is
rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from write_v2lite_checkpoint import write_checkpoint  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from engine.kernels import mla_decode  # noqa: E402

COMPUTE_PEAK = 790e12  # dense bf16 FLOP/s taken as the H200's prefill ceiling
KV_DTYPES = {"bf16": "auto", "fp8": "fp8_e4m3", "fp8_gluon": "fp8_e4m3", "fp8_triton": "fp8_e4m3"}
# Engine settings a --kv name adds (EngineConfig.mla_decode_kernel): "fp8" is the engine's
# default ("auto": the warp-specialized Gluon decode kernel on Hopper GPUs, else the Triton
# one); "fp8_gluon" asks for the Gluon kernel (refused where it cannot run), "fp8_triton" for
# the Triton kernel.
KV_OPTIONS: dict[str, dict[str, Any]] = {
    "fp8_gluon": {"mla_decode_kernel": "gluon"},
    "fp8_triton": {"mla_decode_kernel": "triton"},
}
OVERLAP = {"auto": None, "on": True, "off": False}  # --overlap -> EngineConfig.enable_overlap

COMPILE_EXPECTED_S = 240.0  # a compile engine beyond a plain engine's start (run E: 175 s + runs)
# The compile engines' graphs and compiled sizes (1, 2, 4, 8, 16): batch 1 and 16 are measured,
# and each compiled size costs start-up time.
COMPILE_MAX_BS = 16


# ---- the model's shape and its ceilings ---------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """DeepSeek-V2's dimensions, from config.json, and what a step must read or compute."""

    layers: int
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    shared: int
    first_dense: int
    vocab: int

    @classmethod
    def from_checkpoint(cls, path: Path) -> Shape:
        c = json.loads((path / "config.json").read_text())
        return cls(
            c["num_hidden_layers"],
            c["hidden_size"],
            c["num_attention_heads"],
            c.get("q_lora_rank"),
            c["kv_lora_rank"],
            c["qk_nope_head_dim"],
            c["qk_rope_head_dim"],
            c["v_head_dim"],
            c["intermediate_size"],
            c["moe_intermediate_size"],
            c.get("n_routed_experts") or 0,
            c["num_experts_per_tok"],
            c.get("n_shared_experts") or 0,
            min(c.get("first_k_dense_replace") or 0, c["num_hidden_layers"]),
            c["vocab_size"],
        )

    @property
    def attn_params(self) -> int:
        """One layer's attention weights and its two norms."""
        h, qk = self.hidden, self.nope + self.rope
        r = self.q_lora_rank
        q = h * self.heads * qk if r is None else h * r + r + r * self.heads * qk
        kv = h * (self.kv_lora_rank + self.rope) + self.kv_lora_rank
        kv += self.kv_lora_rank * self.heads * (self.nope + self.v)
        return q + kv + self.heads * self.v * h + 2 * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_dense if self.experts else 0

    def layer_fixed_params(self) -> int:
        """Weights every token reads whatever the routing: attention, dense MLPs, shared
        experts, routers, final norm."""
        dense = (self.layers - self.moe_layers) * 3 * self.hidden * self.intermediate
        per_moe = self.shared * self.expert_params + self.experts * self.hidden
        return self.layers * self.attn_params + dense + self.moe_layers * per_moe + self.hidden

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts that `tokens` tokens touch in one layer, routing uniform."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)

    def decode_bytes(self, batch: int, context: int, wbytes: int, kvbytes: int) -> float:
        """Bytes a decode step of `batch` requests with `context` KV rows in all must read."""
        params: float = self.layer_fixed_params() + (self.vocab + batch) * self.hidden
        params += self.moe_layers * self.expected_experts(batch) * self.expert_params
        kv = self.layers * (self.kv_lora_rank + self.rope) * kvbytes * context
        return params * wbytes + kv

    def active_params(self) -> int:
        """Parameters one token multiplies through (embedding and LM head aside)."""
        return self.layer_fixed_params() + self.moe_layers * self.top_k * self.expert_params

    def prefill_flops(self, tokens: int, pairs: int, sampled: int) -> float:
        attn = 2.0 * self.layers * self.heads * pairs * (self.nope + self.rope + self.v)
        return 2.0 * tokens * self.active_params() + 2.0 * sampled * self.vocab * self.hidden + attn


# ---- timing the engine from outside -------------------------------------------------------------
@dataclass
class StepRecord:
    decode: bool
    seconds: float
    batch_size: int
    tokens: int  # input tokens of the step
    context: int  # KV rows read: the sum of the requests' sequence lengths
    pairs: int  # causal (query, key) pairs of an extend step
    sampled: int  # rows that drew a token
    profiled: bool
    host_seconds: float = 0.0  # the launching step's wall time less its waits for the device
    device_seconds: float = 0.0  # the device's time for the batch (CUDA events; CPU: wall)


class StepTimer:
    """Times every batch that `core.step()` runs and records what the scheduler handed it.
    Wraps `step`, `schedule` and `record_step` on the instances; `close()` removes the wraps.
    `profile(start, count, batch)` runs torch.profiler over `count` steps, from the step after
    the `start`-th decode step of `batch` requests (all of them decoding: the scheduler gives
    decoders a step between prefill chunks, and those are not the steps to profile)."""

    def __init__(self, core: Any, device: torch.device) -> None:
        self.core = core
        self.device = device
        self.overlap = bool(getattr(core, "overlap", False))
        self.records: list[StepRecord] = []
        self._out: Any = None
        self._device_s: dict[int, float] = {}  # id(schedule output) -> device seconds
        # overlap: (schedule output, host seconds, profiled, return time) of the last step
        self._last: tuple[Any, float, bool, float] | None = None
        self._schedule = core.scheduler.schedule
        self._record_step = core.scheduler.record_step
        self._step = core.step
        core.scheduler.schedule = self._wrapped_schedule
        core.scheduler.record_step = self._wrapped_record_step
        core.step = self._wrapped_step
        self.prof: Any = None
        self._window: tuple[int, int, int] | None = None
        self._profiled_left = 0

    def close(self) -> None:
        del self.core.scheduler.schedule
        del self.core.scheduler.record_step
        del self.core.step

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def profile(self, start: int, count: int, batch: int) -> None:
        self._window = (start, count, batch)
        self.prof = None

    def _wrapped_schedule(self) -> Any:
        self._out = self._schedule()
        return self._out

    def _wrapped_record_step(self, out: Any, seconds: float) -> None:
        self._device_s[id(out)] = seconds
        self._record_step(out, seconds)

    def _wrapped_step(self) -> bool:
        profiling = self._maybe_start_profiler()
        if not self.overlap:
            self.sync()
        t0 = time.perf_counter()
        ran = self._step()
        if not self.overlap:
            self.sync()
        t1 = time.perf_counter()
        host = t1 - t0 - getattr(self.core, "last_wait_s", 0.0)
        out, self._out = self._out, None
        if profiling:
            self._profiled_left -= 1
            if self._profiled_left == 0:
                self.prof.stop()
        if not self.overlap:
            if out is not None:
                self._add(out, t1 - t0, host, profiling)
            return ran
        # The batch the previous step launched was processed in this one: it took from the
        # previous step's return to this one's.
        if self._last is not None:
            last_out, last_host, last_profiled, last_t = self._last
            self._add(last_out, t1 - last_t, last_host, last_profiled)
        self._last = None if out is None else (out, host, profiling, t1)
        return ran

    def _add(self, out: Any, seconds: float, host: float, profiled: bool) -> None:
        device = self._device_s.pop(id(out), seconds)
        self.records.append(_record(out, seconds, profiled, host, device))

    def _maybe_start_profiler(self) -> bool:
        if self._profiled_left > 0:
            return True
        if self._window is None:
            return False
        start, count, batch = self._window
        full = [r.decode and r.batch_size == batch for r in self.records]
        if sum(full) < start or not full[-1]:
            return False
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=acts, acc_events=True)
        self.prof.start()
        self._window = None
        self._profiled_left = count
        return True


def decode_kernel(llm: LLM) -> str:
    """What runs an engine's decode attention: its backend's class name, with the FP8 MLA
    decode kernel where it is the Gluon one."""
    backend = llm.core.runner.attn_backend
    name = type(backend).__name__
    return f"{name} (Gluon MLA decode)" if getattr(backend, "gluon_decode", False) else name


def _record(
    out: Any, seconds: float, profiled: bool, host: float = 0.0, device: float = 0.0
) -> StepRecord:
    batch = out.batch
    decode = "decode" in str(getattr(batch.mode, "value", batch.mode)).lower()
    tokens = context = pairs = 0
    for e in batch.entries:
        n, p = len(e.input_ids), e.prefix_len
        tokens += n
        context += p + n
        pairs += n * p + n * (n + 1) // 2
    return StepRecord(
        decode,
        seconds,
        len(batch.entries),
        tokens,
        context,
        pairs,
        len(out.sample_rows),
        profiled,
        host,
        device,
    )


# ---- measurements -------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2.0 * nbytes * reps / seconds


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


@dataclass
class Ceilings:
    shape: Shape
    wbytes: int  # bytes per weight value
    kvbytes: int  # bytes per KV value
    bandwidth: float  # B/s

    def decode_s(self, r: StepRecord) -> float:
        return self.shape.decode_bytes(r.batch_size, r.context, self.wbytes, self.kvbytes) / (
            self.bandwidth
        )

    def prefill_flops(self, r: StepRecord) -> float:
        return self.shape.prefill_flops(r.tokens, r.pairs, r.sampled)


def decode_phase(dec: list[StepRecord], ceil: Ceilings) -> dict[str, Any] | None:
    if not dec:
        return None
    s = sum(r.seconds for r in dec)
    toks = sum(r.batch_size for r in dec)
    c = sum(ceil.decode_s(r) for r in dec)
    host_ms = 1e3 * statistics.median(r.host_seconds for r in dec)
    wall_ms = 1e3 * statistics.median(r.seconds for r in dec)
    return dict(
        steps=len(dec),
        ms_per_step=1e3 * s / len(dec),
        ms_per_step_median=wall_ms,
        # The host's busy time per step (hidden behind the device with overlap), and the
        # device's own time: wall - device is what the device waits for the host.
        host_ms_per_step_median=host_ms,
        host_share=host_ms / wall_ms,
        device_ms_per_step_median=1e3 * statistics.median(r.device_seconds for r in dec),
        tok_s=toks / s,
        mean_batch=toks / len(dec),
        mean_context=sum(r.context for r in dec) / toks,
        ceiling_ms_per_step=1e3 * c / len(dec),
        ceiling_tok_s=toks / c,
        ceiling_share=c / s,
    )


def phases(records: list[StepRecord], ceil: Ceilings, batch: int = 1) -> dict[str, Any]:
    """The phases of one run of `batch` requests, against their ceilings: `decode` (every step
    without prefill, including those the scheduler slips between prefill chunks), `decode_full`
    (the steps where all `batch` requests decode: the steady state) and `prefill`."""
    dec = [r for r in records if r.decode and not r.profiled]
    pre = [r for r in records if not r.decode and not r.profiled]
    out: dict[str, Any] = {
        "decode": decode_phase(dec, ceil),
        "decode_full": decode_phase([r for r in dec if r.batch_size == batch], ceil),
        "prefill": None,
    }
    if pre:
        # The device's time (CUDA events): with overlap a prefill step's own launch (metadata,
        # kernel compilation on first use) runs inside the step before, so wall intervals
        # would charge it to the decode step it overlaps.
        s = sum(r.device_seconds or r.seconds for r in pre)
        toks = sum(r.tokens for r in pre)
        flops = sum(ceil.prefill_flops(r) for r in pre)
        out["prefill"] = dict(
            steps=len(pre),
            tokens=toks,
            seconds=s,
            tok_s=toks / s,
            tflop_s=flops / s / 1e12,
            ceiling_tok_s=toks / (flops / COMPUTE_PEAK),
            ceiling_share=flops / COMPUTE_PEAK / s,
        )
    return out


def summarize_profile(prof: Any, records: list[StepRecord]) -> dict[str, Any]:
    """Per-step kernels, GPU time and host calls of the profiled steps."""
    steps = sum(r.profiled for r in records)
    events = prof.events()
    gpu = [e for e in events if str(e.device_type).endswith("CUDA")]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        slot = by_name[e.name[:90]]
        slot[0] += 1
        slot[1] += e.time_range.end - e.time_range.start
    gpu_us = sum(e.time_range.end - e.time_range.start for e in gpu)
    cpu_names: dict[str, int] = defaultdict(int)
    for e in events:
        if not str(e.device_type).endswith("CUDA"):
            cpu_names[e.name] += 1
    launches = sum(n for k, n in cpu_names.items() if "LaunchKernel" in k)
    syncs = sum(n for k, n in cpu_names.items() if k.endswith("Synchronize"))
    host_self: dict[str, float] = defaultdict(float)  # host ops by their own time (us)
    for e in events:
        if not str(e.device_type).endswith("CUDA"):
            host_self[e.name] += e.self_cpu_time_total
    prof_walls = [r.seconds for r in records if r.profiled and r.decode]
    walls = [r.seconds for r in records if not r.profiled and r.decode]
    wall_ms = 1e3 * statistics.median(walls) if walls else None
    gpu_ms = gpu_us / 1e3 / steps if gpu else None
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    # One step's kernels in launch order (the first of the profiled steps, which all run the
    # same graph at one batch size): name, duration and the idle gap before each, in us.
    ordered = sorted(kernels, key=lambda e: e.time_range.start)[: len(kernels) // max(steps, 1)]
    timeline = [
        [e.name[:70], round(e.time_range.end - e.time_range.start, 2),
         round(e.time_range.start - ordered[i - 1].time_range.end, 2) if i else 0.0]
        for i, e in enumerate(ordered)
    ]  # fmt: skip
    return dict(
        steps=steps,
        all_decode=all(r.decode for r in records if r.profiled),
        batch_sizes=sorted({r.batch_size for r in records if r.profiled}),
        kernels_per_step=len(kernels) / steps if gpu else None,
        memcpy_memset_per_step=(len(gpu) - len(kernels)) / steps if gpu else None,
        gpu_ms_per_step=gpu_ms,
        wall_ms_per_step=wall_ms,
        wall_ms_per_step_profiled=1e3 * statistics.median(prof_walls) if prof_walls else None,
        gpu_idle_ms_per_step=wall_ms - gpu_ms if wall_ms is not None and gpu_ms else None,
        kernel_launch_calls_per_step=launches / steps,
        host_syncs_per_step=syncs / steps,  # cuda{Stream,Event,Device}Synchronize calls
        graph_launches_per_step=cpu_names.get("cudaGraphLaunch", 0) / steps,
        aten_ops_per_step=sum(n for k, n in cpu_names.items() if k.startswith("aten::")) / steps,
        top_kernels=[
            dict(name=name, per_step=n / steps, ms_per_step=us / 1e3 / steps)
            for name, (n, us) in top
        ],
        step_timeline=timeline,
        top_host_ops=[
            dict(name=name[:90], per_step=cpu_names[name] / steps, ms_per_step=us / 1e3 / steps)
            for name, us in sorted(host_self.items(), key=lambda kv: -kv[1])[:15]
        ],
    )


# ---- the benchmark ------------------------------------------------------------------------------
def compile_speedups(result: dict[str, Any], compiled: dict[str, Any]) -> dict[str, float]:
    """Graphs-alone time over graphs + compile time (above 1: compile is faster), for batch-1
    decode and for the decode phase of each request count both engines ran (bf16 KV)."""
    out: dict[str, float] = {}
    graphs = result["batch1"].get("graphs_bf16") or result["batch1"].get("default_bf16")  # CPU
    if graphs and compiled.get("batch1"):
        key = "ms_per_step_median"
        out["batch1"] = round(graphs[key] / compiled["batch1"][key], 3)
    plain = {r["n"]: r for r in result["runs"] if r.get("kv") == "bf16"}
    for r in compiled.get("runs", []):
        base = plain.get(r.get("n"))
        a = ((base or {}).get("decode") or {}).get("ms_per_step_median")
        b = (r.get("decode") or {}).get("ms_per_step_median")
        if a and b:
            out[f"n{r['n']}_decode"] = round(a / b, 3)
    return out


def compiled_sizes(llm: LLM) -> list[int]:
    """With graphs: the batch sizes compiled at start-up (none if compiling failed and the
    graphs were captured without); without (CPU): the sizes the runs compiled."""
    runner = llm.core.runner
    compiled = runner.graph_runner or runner.compiled_decode
    return sorted(getattr(compiled, "compiled_sizes", []))


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        ckpt: Path,
        device: torch.device,
        bandwidth: float,
        t0: float,
    ) -> None:
        self.args = args
        self.ckpt = ckpt
        self.device = device
        self.shape = Shape.from_checkpoint(ckpt)
        self.seed = 1000
        self.t0 = t0  # when the measurements started: the time budget counts from there
        self.bandwidth = bandwidth

    def over_budget(self, expected_s: float = 0.0) -> bool:
        """Would something that takes `expected_s` end after the time budget?"""
        return time.perf_counter() - self.t0 + expected_s > self.args.time_budget

    def make_llm(self, **overrides: Any) -> LLM:
        a = self.args
        kw: dict[str, Any] = dict(device=a.device, max_running_requests=a.max_running)
        if a.tp_size > 1:
            kw.update(tp_size=a.tp_size, cuda_graph_with_tp=a.tp_graphs)
        kw["enable_overlap"] = OVERLAP[a.overlap]
        if a.max_context_len:
            kw["max_context_len"] = a.max_context_len
        kw.update(overrides)
        return LLM(str(self.ckpt), **kw)

    def release(self) -> None:
        """Give the memory of engines that are gone back to the device: the next engine sizes
        its KV pool from what is free. Callers shut the engine down and drop their last
        reference first (to the LLM and to anything of its runner: a graph runner held in a
        local keeps the weights and the KV pool)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            logging.info("device memory free: %.1f of %.1f GiB", free / 2**30, total / 2**30)

    def allocator_counts(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
        return {k: int(stats.get(k, 0)) for k in keys}

    def prompts(self, n: int, length: int | None = None) -> list[list[int]]:
        self.seed += 1  # new ids each run: no prefix of one run is cached from another
        return random_prompts(n, length or self.args.prompt_len, self.shape.vocab, self.seed)

    def generate(self, llm: LLM, n: int, max_tokens: int, length: int | None = None) -> float:
        """Seconds for n fresh prompts to each produce max_tokens tokens."""
        prompts = self.prompts(n, length)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        got = sum(len(o.token_ids) for o in outs)
        assert got == n * max_tokens, f"expected {n * max_tokens} tokens, got {got}"
        return seconds

    def ceilings(self, llm: LLM, kv: str) -> Ceilings:
        wbytes = torch.empty(0, dtype=llm.core.runner.dtype).element_size()
        return Ceilings(self.shape, wbytes, 1 if kv.startswith("fp8") else wbytes, self.bandwidth)

    def batch1_engine(self, profile: bool = False, **overrides: Any) -> dict[str, Any] | None:
        """Batch-1 decode of an engine of its own (eager, overlap flipped), with `profile` a
        profile of its batch-1 steps too (under "profile"); a config the engine refuses is
        reported as unavailable."""
        try:
            llm = self.make_llm(**overrides)
        except ConfigError as e:
            return {"unavailable": str(e)}
        try:
            result = self.batch1(llm, self.ceilings(llm, "bf16"))
            if profile and result is not None:
                result["profile"] = self.profile(llm, 1)
            return result
        finally:
            llm.shutdown()
            del llm
            self.release()

    def fp8_absorb_engine(self) -> dict[str, Any]:
        """absorbed_weight_dtype="fp8_e4m3", an engine of its own (bf16 KV, the default graphs):
        batch-1 decode and the `--fp8-absorb-ns` runs."""
        t0 = time.perf_counter()
        try:
            llm = self.make_llm(absorbed_weight_dtype="fp8_e4m3")
        except ConfigError as e:
            return {"unavailable": str(e)}
        out: dict[str, Any] = dict(engine_s=time.perf_counter() - t0, runs=[])
        try:
            graphs = getattr(llm.core.runner, "graph_runner", None) is not None
            out["batch1_name"] = f"{'graphs' if graphs else 'default'}_bf16_fp8absorb"
            ceil = self.ceilings(llm, "bf16")
            out["batch1"] = self.batch1(llm, ceil)
            for n in self.args.fp8_absorb_ns_list:
                out["runs"].append(dict(kv="bf16", **self.run_n(llm, n, ceil)))
                say("fp8 absorbed weights: " + row(out["runs"][-1]))
            return out
        finally:
            llm.shutdown()
            del llm
            self.release()

    def compile_engine(self, layers: str) -> dict[str, Any]:
        """Graphs + torch.compile (torch_compile_layers=`layers`), an engine of its own with
        graphs and compile up to batch COMPILE_MAX_BS: its start-up time (compilation and
        capture), batch-1 decode, and the `--compile-ns` runs."""
        t0 = time.perf_counter()
        try:
            llm = self.make_llm(
                enable_torch_compile=True,
                torch_compile_layers=layers,
                torch_compile_backend=self.args.compile_backend,
                cuda_graph_max_bs=COMPILE_MAX_BS,
                torch_compile_max_bs=COMPILE_MAX_BS,
            )
        except ConfigError as e:
            return {"unavailable": str(e)}
        out: dict[str, Any] = dict(layers=layers, engine_s=time.perf_counter() - t0)
        try:
            ceil = self.ceilings(llm, "bf16")
            out["batch1"] = self.batch1(llm, ceil)
            # Its batch-1 step kernel by kernel, beside the graphs-only engine's profile: where
            # the compiled step's time goes (run N found compile slower and could not say why).
            out["profile"] = self.profile(llm, 1)
            out["runs"] = []
            for n in self.args.compile_ns_list:
                out["runs"].append(dict(kv="bf16", **self.run_n(llm, n, ceil)))
                say(f"graphs + compile ({layers}): " + row(out["runs"][-1]))
            out["compiled_sizes"] = compiled_sizes(llm)
            return out
        finally:
            llm.shutdown()
            del llm
            self.release()

    def batch1(self, llm: LLM, ceil: Ceilings) -> dict[str, Any]:
        """Decode ms/step of one request (median over its decode steps)."""
        if not self.args.no_warmup:
            self.generate(llm, 1, 4)
        timer = StepTimer(llm.core, self.device)
        try:
            self.generate(llm, 1, self.args.b1_tokens)
        finally:
            timer.close()
        return phases(timer.records, ceil)["decode_full"]

    def run_n(self, llm: LLM, n: int, ceil: Ceilings) -> dict[str, Any]:
        a = self.args
        warm_s = None
        if not a.no_warmup:  # same shapes, a few tokens: Triton compiles before the timed run
            warm_s = self.generate(llm, n, 2)
        graphs = getattr(llm.core.runner, "graph_runner", None)
        replays = getattr(graphs, "replays", 0)
        timer = StepTimer(llm.core, self.device)
        before = self.allocator_counts()
        try:
            seconds = self.generate(llm, n, a.max_tokens)
        finally:
            timer.close()
        result = dict(n=n, e2e_s=seconds, e2e_tok_s=n * a.max_tokens / seconds, warmup_s=warm_s)
        result["graph_replays"] = getattr(graphs, "replays", 0) - replays
        # cudaMalloc / cudaFree calls and out-of-memory retries (which free the cache and sync)
        # in the timed run: a steady state makes none.
        after = self.allocator_counts()
        result["allocator"] = {k: after[k] - before[k] for k in after}
        result.update(phases(timer.records, ceil, n))
        return result

    def profile(self, llm: LLM, n: int) -> dict[str, Any]:
        timer = StepTimer(llm.core, self.device)
        warm, count = 3, self.args.profile_steps
        timer.profile(warm, count, n)
        # The first requests decode between the prefill steps of the others (the scheduler
        # alternates them, and a time budget may cut a chunk short): they are that many tokens
        # ahead when all n decode, and must not finish inside the window.
        chunks = -(-n * self.args.prompt_len // llm.config.chunked_prefill_size)
        try:
            self.generate(llm, n, warm + count + 4 * chunks + 64)
        finally:
            timer.close()
            if timer._profiled_left > 0:  # the run ended inside the window
                timer.prof.stop()
        if timer.prof is None:
            return {"error": "the profiler did not start"}
        return summarize_profile(timer.prof, timer.records)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    args.device = device.type
    result: dict[str, Any] = dict(meta=meta(args, device))

    def save() -> None:
        result["total_s"] = time.perf_counter() - t_start
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))

    ckpt = Path(args.out)
    result["checkpoint"] = write_checkpoint(ckpt, args.layers, args.tiny, device.type)
    say(f"checkpoint: {json.dumps(result['checkpoint'])}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engines size their KV pools from the free memory
    result["copy_bandwidth_Bps"] = bw
    say(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")
    # The time budget counts the measurements, not the checkpoint write (a minute on a fresh
    # device) before them.
    bench = Bench(args, ckpt, device, bw, time.perf_counter())
    b1_context = args.prompt_len + args.b1_tokens // 2  # the mean context of the batch-1 run
    result["decode_ceiling_batch1_ms"] = 1e3 * bench.shape.decode_bytes(1, b1_context, 2, 2) / bw
    result.update(kv_tokens={}, batch1={}, runs=[], profile={}, skipped=[], errors={}, task_s={})
    result["decode_kernel"] = {}
    save()

    kvs = [k for k in dict.fromkeys(args.kv.split(",")) if k in KV_DTYPES]  # in the order given
    profile_ns = [int(x) for x in args.profile_ns.split(",") if x]
    per_engine = {
        kv: 1 + len(args.ns_list) + (len(profile_ns) if kv == args.profile_kv else 0) for kv in kvs
    }
    compile_layers = [] if args.skip_compile else [x for x in args.compile_layers.split(",") if x]
    tasks = int(not args.skip_eager) + len(compile_layers) + int(args.overlap_compare)
    tasks += sum(per_engine.values())
    tasks += int(args.fp8_absorb_compare)
    bar = tqdm(total=tasks, desc="bench_engine", unit="task")

    took: dict[str, float] = result["task_s"]

    def task(
        name: str, fn: Callable[[], Any], like: str | None = None, expected_s: float = 0.0
    ) -> Any:
        """Run one measurement unless it would end after the time budget (it is expected to
        take as long as the task `like` took, plus `expected_s`). An error is recorded and the
        run goes on (a CUDA error that breaks the device then fails the later tasks too)."""
        bar.set_description(name)
        t0 = time.perf_counter()
        try:
            if bench.over_budget(took.get(like or "", 0.0) + expected_s):
                result["skipped"].append(name)
                return None
            return fn()
        except Exception as e:
            logging.exception("%s failed", name)
            result["errors"][name] = f"{type(e).__name__}: {e}"
            return None
        finally:
            took[name] = time.perf_counter() - t0
            bar.update(1)
            save()

    # Eager first: it also compiles the Triton kernels that the graph captures then reuse.
    if not args.skip_eager:
        eager = result["batch1"]["eager_bf16"] = task(
            "eager batch 1",
            lambda: bench.batch1_engine(args.profile_eager, enable_cuda_graph=False),
        )
        if eager and "profile" in eager:
            result["profile"]["eager_b1"] = eager.pop("profile")
    if args.overlap_compare:  # the default engine's batch 1 with the overlap schedule flipped
        main_on = OVERLAP[args.overlap]
        flipped = not (device.type == "cuda" if main_on is None else main_on)
        result["batch1"][f"overlap_{'on' if flipped else 'off'}_bf16"] = task(
            "overlap batch 1",
            lambda: bench.batch1_engine(enable_overlap=flipped, cuda_graph_max_bs=8),
        )
    for kv in kvs:
        if bench.over_budget(took.get("bf16 engine", 0.0)):
            result["skipped"].append(f"{kv} engine")
            bar.update(per_engine[kv])
            save()
            continue
        t0 = time.perf_counter()
        llm = bench.make_llm(kv_cache_dtype=KV_DTYPES[kv], **KV_OPTIONS.get(kv, {}))
        took[f"{kv} engine"] = time.perf_counter() - t0
        try:
            result["kv_tokens"][kv] = llm.core.runner.max_total_tokens
            result["decode_kernel"][kv] = decode_kernel(llm)
            graphs = getattr(llm.core.runner, "graph_runner", None) is not None
            ceil = bench.ceilings(llm, kv)
            name = f"graphs_{kv}" if graphs else f"default_{kv}"
            b1 = result["batch1"][name] = task(
                f"{kv} batch 1", partial(bench.batch1, llm, ceil), "bf16 batch 1"
            )
            if b1:
                say(
                    f"batch-1 decode, {name}: {b1['ms_per_step_median']:.2f} ms/step, host "
                    f"{b1['host_ms_per_step_median']:.2f} ms, device "
                    f"{b1['device_ms_per_step_median']:.2f} ms"
                )
            for n in args.ns_list:
                r = task(f"{kv} N={n}", partial(bench.run_n, llm, n, ceil), f"bf16 N={n}")
                if r:
                    result["runs"].append(dict(kv=kv, **r))
                    say(row(result["runs"][-1]))
            if kv == args.profile_kv:
                for n in profile_ns:
                    p = task(f"profile b={n}", partial(bench.profile, llm, n))
                    if p:
                        result["profile"][f"{kv}_b{n}"] = p
        finally:
            llm.shutdown()
            del llm
            bench.release()
    # Compile engines after the graphs-only ones: a compiled engine's memory does not all come
    # back when it is deleted (run E: 20.8 of 139.8 GiB free after it, and the graphs-only
    # engine that was to follow could not start), so the same-run comparison needs this order.
    result["compile"] = {}
    for layers in compile_layers:
        c = result["compile"][layers] = task(
            f"compile {layers}",
            partial(bench.compile_engine, layers),
            "bf16 engine",  # its start, plus compiling (run E, cold cache: 168 s) and its runs
            expected_s=COMPILE_EXPECTED_S,
        )
        if c and "profile" in c:
            result["profile"][f"compile_{layers}_b1"] = c.pop("profile")
        if c and "batch1" in c:
            result["batch1"][f"compile_{layers}_bf16"] = c["batch1"]
            c["vs_graphs"] = compile_speedups(result, c)
            say(
                f"graphs + compile ({layers}): engine start {c['engine_s']:.0f} s (sizes "
                f"{c['compiled_sizes']} compiled), batch-1 "
                f"{c['batch1']['ms_per_step_median']:.2f} ms/step; against graphs alone in "
                f"this run: {c['vs_graphs']}"
            )
    if args.fp8_absorb_compare:  # as long as the bf16 engine's start, batch 1 and same Ns took
        like = ["bf16 engine", "bf16 batch 1", *(f"bf16 N={n}" for n in args.fp8_absorb_ns_list)]
        f = result["fp8_absorb"] = task(
            "fp8 absorbed weights",
            bench.fp8_absorb_engine,
            expected_s=sum(took.get(k, 0.0) for k in like),
        )
        if f and "batch1" in f:
            result["batch1"][f["batch1_name"]] = f["batch1"]
    bar.close()
    save()
    return result


# ---- output -------------------------------------------------------------------------------------
def say(text: str) -> None:
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def row(r: dict[str, Any]) -> str:
    d, p = r.get("decode_full") or {}, r.get("prefill") or {}
    share = d.get("ceiling_share")
    pshare = p.get("ceiling_share")
    return (
        f"{r['kv']:<5}{r['n']:>5} | {r['e2e_tok_s']:>9.1f} | "
        f"{_f(d.get('ms_per_step'), '.2f'):>8} {_f(d.get('ms_per_step_median'), '.2f'):>7} "
        f"{_f(d.get('tok_s')):>9} "
        f"{_f(d.get('ceiling_tok_s')):>9} {_f(share and 100 * share, '.0f'):>4}% | "
        f"{_f(p.get('tok_s'), '.0f'):>9} {_f(p.get('tflop_s')):>7} "
        f"{_f(pshare and 100 * pshare, '.0f'):>4}%"
    )


HEADER = (
    "decode: the steps where all N requests decode (ms/step mean and median: a stall shows as\n"
    "a mean above the median); of% = share of the ceiling\n"
    "kv       N | e2e tok/s |  dec ms/st  median dec tok/s  ceil t/s  of% "
    "| pre tok/s TFLOP/s  of%\n" + "-" * 94
)


def report(res: dict[str, Any]) -> str:
    lines = [f"copy bandwidth {res['copy_bandwidth_Bps'] / 1e9:.0f} GB/s"]
    b1 = res["batch1"]
    parts = []
    for name, d in b1.items():
        if d and "ms_per_step_median" in d:
            parts.append(
                f"{name} {d['ms_per_step_median']:.2f} (host {d['host_ms_per_step_median']:.2f})"
            )
        elif d:
            parts.append(f"{name} n/a ({d.get('unavailable', '').split(';')[0][:60]})")
    lines.append(
        f"batch-1 decode ms/step: {' | '.join(parts)} | ceiling "
        f"{res['decode_ceiling_batch1_ms']:.2f}"
    )
    kv = res["kv_tokens"]
    ratio = f" ({kv['fp8'] / kv['bf16']:.2f}x)" if "bf16" in kv and "fp8" in kv else ""
    lines.append("KV tokens: " + " | ".join(f"{k} {v:,}" for k, v in kv.items()) + ratio)
    kernels = res.get("decode_kernel") or {}
    lines.append("decode attention: " + " | ".join(f"{k} {v}" for k, v in kernels.items()))
    lines += [HEADER] + [row(r) for r in res["runs"]]
    for layers, c in (res.get("compile") or {}).items():
        if not c or "engine_s" not in c:
            lines.append(f"graphs + compile ({layers}): {c}")
            continue
        lines.append(
            f"graphs + compile ({layers}): engine start {c['engine_s']:.0f} s, compiled sizes "
            f"{c['compiled_sizes']}"
        )
        lines += [row(r) for r in c.get("runs", [])]
    for name, p in res["profile"].items():
        if "error" in p:
            lines.append(f"profile {name}: {p['error']}")
            continue
        lines.append(
            f"profile {name}: {_f(p['kernels_per_step'], '.0f')} kernels/step, GPU "
            f"{_f(p['gpu_ms_per_step'], '.2f')} ms, wall {_f(p['wall_ms_per_step'], '.2f')} ms, "
            f"GPU idle {_f(p['gpu_idle_ms_per_step'], '.2f')} ms, "
            f"{p['kernel_launch_calls_per_step']:.0f} launches + "
            f"{p['graph_launches_per_step']:.0f} graph launches, "
            f"{p['aten_ops_per_step']:.0f} aten ops, "
            f"{p['host_syncs_per_step']:.0f} host syncs per step"
        )
        for k in p["top_kernels"][:5]:
            lines.append(f"    {k['ms_per_step']:7.3f} ms {k['per_step']:6.1f}x  {k['name'][:70]}")
        for k in p["top_host_ops"][:5]:
            lines.append(
                f"    host {k['ms_per_step']:7.3f} ms {k['per_step']:6.1f}x  {k['name'][:65]}"
            )
    lines += order_report(res["runs"])
    lines += fp8_absorb_report(res)
    if res["skipped"]:
        lines.append(f"skipped (time budget): {', '.join(res['skipped'])}")
    lines.append(f"total {res['total_s']:.0f} s")
    return "\n".join(lines)


def order_report(runs: list[dict[str, Any]]) -> list[str]:
    """--abba: per N, each dtype's end-to-end, decode and prefill figures averaged over the
    processes that ran it (one early in the call, one late), and FP8 against bf16. The engine
    of the call's first process lost its prefill phase in runs Z1 and Z2 (perf/RESULTS.md),
    whichever dtype it was."""
    by: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[(r["n"], r["kv"])].append(r)
    if not any(len(v) > 1 for v in by.values()):
        return []

    def mean(rs: list[dict[str, Any]], phase: str | None, key: str) -> float | None:
        vals = [(r.get(phase) or {}).get(key) if phase else r.get(key) for r in rs]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    order = [kv for _, kv in sorted({(r.get("process", 0), r["kv"]) for r in runs})]
    lines = [f"mean over each dtype's processes (in the order {', '.join(order)}):"]
    for n in sorted({n for n, _ in by}):
        cells, e2e = [], {}
        for kv in KV_DTYPES:
            rs = by.get((n, kv))
            if not rs:
                continue
            e2e[kv] = mean(rs, None, "e2e_tok_s")
            cells.append(
                f"{kv} e2e {_f(e2e[kv], '.1f')} tok/s, decode "
                f"{_f(mean(rs, 'decode_full', 'ms_per_step_median'), '.2f')} ms, prefill "
                f"{_f(mean(rs, 'prefill', 'tok_s'), '.0f')} tok/s"
            )
        ratio = ""
        for fp8 in ("fp8", "fp8_gluon", "fp8_triton"):
            if e2e.get(fp8) and e2e.get("bf16"):
                ratio += f" | {fp8}/bf16 e2e {e2e[fp8] / e2e['bf16']:.3f}x"
        lines.append(f"    N={n}: " + "; ".join(cells) + ratio)
    return lines


def fp8_absorb_report(res: dict[str, Any]) -> list[str]:
    """The FP8 absorbed-weights engine's rows, each with the bf16 engine's decode step time
    at the same N (bf16 KV) and the ratio."""
    f = res.get("fp8_absorb")
    if not f:
        return []
    if "runs" not in f:
        return [f"fp8 absorbed weights: {f}"]
    lines = [
        f"fp8 absorbed weights (w_kc, w_vc in e4m3; bf16 KV): engine start {f['engine_s']:.0f} s"
    ]
    base_b1 = next(
        (d for k, d in res["batch1"].items() if k in ("graphs_bf16", "default_bf16") and d), None
    )
    runs = [dict(f["batch1"], n=1, batch1=True)] if f.get("batch1") else []
    runs += f["runs"]
    for r in runs:
        if r.get("batch1"):
            ours, base = r.get("ms_per_step_median"), (base_b1 or {}).get("ms_per_step_median")
            label = "batch 1 (median step)"
        else:
            ours = (r.get("decode_full") or {}).get("ms_per_step")
            same = [x for x in res["runs"] if x["kv"] == "bf16" and x["n"] == r["n"]]
            base = (same[0].get("decode_full") or {}).get("ms_per_step") if same else None
            label = f"N={r['n']} (decode phase)"
        ratio = f"{base / ours:.3f}x" if ours and base else "-"
        lines.append(
            f"    {label:<22} fp8 {_f(ours, '.3f')} ms/step, bf16 {_f(base, '.3f')} ms/step, "
            f"speed-up {ratio}"
        )
    lines += [row(r) for r in f["runs"]]
    return lines


def _git(*cmd: str) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        return ""


def meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    # NOTE: what git says in this copy of the repository; a copy whose .git is not the working
    # tree's own reports another commit. Name the commit in RESULTS.md from the source side.
    commit = _git("rev-parse", "--short", "HEAD").strip()
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    versions: dict[str, str | None] = {"torch": str(torch.__version__)}
    for mod in ("triton", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        commit=commit or None,
        uncommitted_changes=dirty if commit else None,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        versions=versions,
        args={k: v for k, v in vars(args).items() if k != "ns_list"},
        compute_peak_flops=COMPUTE_PEAK,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="/tmp/bench-v2lite", help="checkpoint directory (reused)")
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (default: 27)")
    ap.add_argument("--tiny", action="store_true", help="a small shape that runs on CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="N = 1,16,64 and 64 new tokens")
    ap.add_argument("--ns", default=None, help="request counts, e.g. 1,16 (default 1,16,...,256)")
    ap.add_argument(
        "--kv",
        default="bf16,fp8",
        help="KV dtypes to run, in this order: bf16, fp8 (the engine's default decode kernel), "
        "fp8_gluon and fp8_triton (FP8 with the Gluon decode kernel, sm_90, or the Triton one)",
    )
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (tiny: 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (quick: 64)")
    ap.add_argument("--b1-tokens", type=int, default=None, help="batch-1 run length (64)")
    ap.add_argument("--profile-ns", default="1,16", help="batch sizes to profile")
    ap.add_argument(
        "--profile-kv", default="bf16", choices=sorted(KV_DTYPES),
        help="the KV dtype (of --kv) whose engine is profiled",
    )  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=5, help="decode steps profiled")
    ap.add_argument(
        "--profile-eager", action="store_true", help="also profile the eager engine's batch 1"
    )
    ap.add_argument("--max-running", type=int, default=None, help="default max(64, max N)")
    ap.add_argument("--max-context-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up run before each N")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="no eager batch-1 engine")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="each KV dtype's engines in a process of their own, in --kv order (see run_isolated)",
    )
    ap.add_argument(
        "--abba",
        action="store_true",
        help="with --isolate: the --kv order, then the reverse (fp8, bf16, bf16, fp8), each "
        "dtype's figures averaged over its two processes",
    )
    ap.add_argument(
        "--compile-layers",
        default="native",
        help="torch_compile_layers of the compile engines, e.g. native,kernels (one engine each)",
    )
    ap.add_argument("--compile-ns", default="16", help="request counts run with compile on")
    ap.add_argument("--compile-backend", default="inductor", help="torch_compile_backend")
    ap.add_argument(
        "--overlap", choices=sorted(OVERLAP), default="auto", help="enable_overlap of the engines"
    )
    ap.add_argument(
        "--overlap-compare",
        action="store_true",
        help="also batch-1 decode with the overlap schedule flipped (its own engine)",
    )
    ap.add_argument(
        "--fp8-absorb-compare",
        action="store_true",
        help="also an engine with absorbed_weight_dtype=fp8_e4m3: batch 1 and --fp8-absorb-ns",
    )
    ap.add_argument("--fp8-absorb-ns", default="64", help="request counts of that engine")
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds; see above")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (tiny: 1)")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    ap.add_argument(
        "--tp-graphs", action="store_true", help="with --tp-size > 1: cuda_graph_with_tp"
    )
    ap.add_argument("--json", help="write the results here (rewritten after every task)")
    ap.add_argument(
        "--merge-project-max-splits", type=int, default=None,
        help="mla_decode.MERGE_PROJECT_MAX_SPLITS for this run (64: the split merge and W_UV "
        "in one kernel at any split count, the choice before run AR)",
    )  # fmt: skip
    ap.add_argument(
        "--pv-regs", action="store_true",
        help="mla_decode.GLUON_PV_REGS_TOKENS 0: the FP8 Gluon kernel reads V into registers "
        "at any size",
    )  # fmt: skip
    ap.add_argument(
        "--slots-ahead2", action="store_true",
        help="mla_decode.GLUON_SLOTS_AHEAD 2: the Gluon kernels' loader reads slot ids two "
        "tiles ahead at page size 1",
    )  # fmt: skip
    ap.add_argument(
        "--merge-inside", action="store_true",
        help="mla_decode.GLUON_MERGE_INSIDE on: the split merge inside the 16-head Gluon kernel",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.ns:
        a.ns_list = [int(x) for x in a.ns.split(",")]
    elif a.tiny:
        a.ns_list = [1, 4] if a.quick else [1, 4, 16]
    else:
        a.ns_list = [1, 16, 64] if a.quick else [1, 16, 64, 128, 256]
    a.compile_ns_list = [int(x) for x in a.compile_ns.split(",") if x]
    a.fp8_absorb_ns_list = [int(x) for x in a.fp8_absorb_ns.split(",") if x]
    a.prompt_len = a.prompt_len or (32 if a.tiny else 512)
    a.max_tokens = a.max_tokens or (8 if a.tiny else 64 if a.quick else 256)
    a.b1_tokens = a.b1_tokens or (8 if a.tiny else 64)
    a.max_running = a.max_running or max(64, *a.ns_list, *a.fp8_absorb_ns_list)
    return a


# Flags a child of run_isolated keeps only where they belong: the eager and overlap engines and
# the profile in the first child, the compile and FP8-weight engines in the last.
_FIRST_ONLY = ("--overlap-compare", "--profile-eager")
_LAST_ONLY = ("--fp8-absorb-compare",)


def run_isolated(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """`--isolate`: one child process of this script per KV dtype, in `--kv` order, merged into
    one result. In one process, the host time per step of a later engine ran 1.2-2x that of an
    earlier one on the H200 (perf/RESULTS.md, runs N and Q), which made the second KV dtype
    look slower; a process of its own gives each the same start. The first child writes the
    checkpoint and runs the eager engine; the last runs the compile and FP8-weight engines
    (its compile ratio is taken against the merged graphs figures). Each child gets an equal
    share of what is left of `--time-budget`."""
    kvs = [k for k in dict.fromkeys(args.kv.split(",")) if k in KV_DTYPES]
    if args.abba:  # then in reverse: each dtype once early and once late in the device call
        kvs = kvs + kvs[::-1]
    t0 = time.perf_counter()
    merged: dict[str, Any] = {}
    children: list[dict[str, Any]] = []
    for i, kv in enumerate(kvs):
        child = [a for a in argv if a not in ("--isolate", "--abba")]
        if i > 0:
            child = [a for a in child if a not in _FIRST_ONLY] + ["--skip-eager"]
        if i < len(kvs) - 1:
            child = [a for a in child if a not in _LAST_ONLY] + ["--skip-compile"]
        suffix = f".{kv}.{i}.json" if args.abba else f".{kv}.json"
        out = Path(args.json or "bench_engine.json").with_suffix(suffix)
        budget = (args.time_budget - (time.perf_counter() - t0)) / (len(kvs) - i)
        child += ["--kv", kv, "--json", str(out), "--time-budget", f"{max(budget, 1.0):.0f}"]
        say(f"isolated: the {kv} engines in a process of their own")
        out.unlink(missing_ok=True)  # a file of an earlier run is no result of this one
        start = time.perf_counter()
        code = subprocess.run([sys.executable, str(Path(__file__).resolve()), *child]).returncode
        res = json.loads(out.read_text()) if out.is_file() and code == 0 else {}
        children.append(dict(kv=kv, returncode=code, seconds=time.perf_counter() - start,
                             copy_bandwidth_Bps=res.get("copy_bandwidth_Bps")))  # fmt: skip
        if not res:
            continue
        for r in res.get("runs", []):
            r["process"] = i  # the child's place in the call's order
        if not merged:
            merged = res
            continue
        for key in (
            "kv_tokens",
            "decode_kernel",
            "batch1",
            "profile",
            "errors",
            "task_s",
            "compile",
        ):
            merged.setdefault(key, {}).update(res.get(key, {}))
        for key in ("runs", "skipped"):
            merged.setdefault(key, []).extend(res.get(key, []))
        if "fp8_absorb" in res:
            merged["fp8_absorb"] = res["fp8_absorb"]
    for c in merged.get("compile", {}).values():
        if c and "batch1" in c:
            c["vs_graphs"] = compile_speedups(merged, c)
    merged["isolated"] = children
    merged["total_s"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=2, default=str))
    return merged


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge_project_max_splits is not None:
        mla_decode.MERGE_PROJECT_MAX_SPLITS = args.merge_project_max_splits
    if args.merge_inside:
        mla_decode.GLUON_MERGE_INSIDE = True
    if args.pv_regs:
        mla_decode.GLUON_PV_REGS_TOKENS = 0
    if args.slots_ahead2:
        mla_decode.GLUON_SLOTS_AHEAD = 2
    if args.isolate:
        res = run_isolated(args, argv)
        failed = [c for c in res.get("isolated", []) if c["returncode"] != 0]
        if "copy_bandwidth_Bps" in res:
            print(report(res), flush=True)
        if failed or "copy_bandwidth_Bps" not in res:
            print(f"isolated run failed: {failed or res.get('isolated')}", file=sys.stderr)
            return 1
        return 0
    threads = args.threads or (1 if args.tiny else None)
    if threads:  # tiny tensors: more threads only wait on each other on a busy machine
        torch.set_num_threads(threads)
    res = run(args)
    print(report(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
