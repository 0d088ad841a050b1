"""CUDA graphs for small decode batches (SGLang's CudaGraphRunner).

A decode step of a small batch is bound by kernel launches, not by the GPU: every layer is a
handful of small kernels. At start-up the runner captures one graph per batch size in
`capture_sizes` (the model forward and the logits) over static input buffers. A decode batch of
b requests replays the smallest captured graph of size >= b; the extra rows are padding: they
write their KV to the reserved slot 0, read one context token, and their logits are dropped.

The attention backend sets up the metadata of the captured batches through its graph hooks
(`init_forward_metadata_capture` / `_replay`). The kernels choose their split count from the
batch size and the longest context; a graph is captured for the longest context the request
table allows, so its split count holds for every batch it replays (empty splits exit at once).

With torch.compile (`compile_config`), the graphs of batch sizes up to torch_compile_max_bs
capture the compiled forward instead (engine/executor/compile.py): its warm-up runs compile it.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.executor.compile import DecodeForward, compile_decode_forward, traced_layers
from engine.forward_batch import ForwardBatch, ForwardContext
from engine.scheduler.batch import ForwardMode


class DecodeModel(Protocol):
    """What a graph captures: the model's forward and its logits."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


logger = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """A graph could not be captured and the device is no longer usable."""


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to 64, then of 16 (and max_bs itself): a padded
    batch wastes at most 1/5 of its rows above 64 requests."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    sizes += list(range(8, min(max_bs, 64) + 1, 8)) + list(range(80, max_bs, 16))
    return sorted({b for b in sizes if b < max_bs} | {max_bs})


class CudaGraphRunner:
    @torch.inference_mode()  # as the eager forward: no autograd state kept by the graphs
    def __init__(
        self,
        model: DecodeModel,
        ctx: ForwardContext,
        device: torch.device,
        max_bs: int,
        max_context_len: int,
        compile_config: EngineConfig | None = None,
    ) -> None:
        self.model, self.ctx = model, ctx
        self.max_context_len = max_context_len
        self.capture_sizes = capture_sizes(max_bs)
        self.max_bs = self.capture_sizes[-1]
        self.replays = 0  # decode steps served from a graph (for tests and metrics)
        dev, n = device, self.max_bs
        # Padding rows keep these values: token 0 at position 0, written to slot 0, reading
        # one context token through request row 0.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.extend_lens = torch.ones(n, dtype=torch.int64, device=dev)
        ctx.attn_backend.init_cuda_graph_state(n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # NOTE: one dedicated stream for warm-up and capture. The capture is thread-local, so
        # CUDA calls from other threads (another engine's loop) cannot invalidate it; the
        # default CUDA generator is process-wide, so callers hold DEVICE_LOCK around us too.
        self.stream = torch.cuda.Stream(dev)
        # The sizes whose graphs capture the compiled forward (none without compile_config).
        self.compiled_forward: DecodeForward | None = None
        self.compiled_sizes: list[int] = []
        self.compile_layers = "native"
        if compile_config is not None:
            self.compiled_forward = compile_decode_forward(
                model, compile_config, ctx.attn_backend.traceable
            )
            self.compile_layers = compile_config.torch_compile_layers
            max_compiled = compile_config.torch_compile_max_bs
            self.compiled_sizes = [b for b in self.capture_sizes if b <= max_compiled]
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(dev)[0]
        compile_s = 0.0
        sizes = list(reversed(self.capture_sizes))  # largest first: later graphs reuse its memory
        what = "compiling and capturing" if self.compiled_sizes else "capturing"
        with tqdm(sizes, desc=f"{what} decode graphs", unit="graph", leave=False) as bar:
            for bs in bar:
                bar.set_postfix(bs=bs, compiled=bs in self.compiled_sizes)
                try:
                    compile_s += self._capture(bs)
                except Exception as e:
                    raise RuntimeError(f"capturing the decode graph of batch size {bs}: {e}") from e
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %s in %.1f s, using %.2f GiB",
            len(self.capture_sizes),
            self.capture_sizes,
            time.perf_counter() - t0,
            (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**30,
        )
        if self.compiled_sizes:
            logger.info(
                "torch.compile (%s layers): batch sizes %s compiled in %.1f s (warm-up included)",
                self.compile_layers,
                self.compiled_sizes,
                compile_s,
            )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The batch a graph of size `bs` runs: views of the static buffers. Its host-side lists
        describe the padding values; the backend's capture hook reads none of them."""
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            self.ctx,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
        )
        self.ctx.attn_backend.init_forward_metadata_capture(fb, self.max_context_len)
        return fb

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        if self.compiled_forward is not None and fb.batch_size in self.compiled_sizes:
            return self.compiled_forward(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))

    def _capture(self, bs: int) -> float:
        """Warm up and capture the graph of size `bs`; returns the seconds of the warm-up (the
        compilation, for a compiled size)."""
        fb = self._static_batch(bs)
        compiled = bs in self.compiled_sizes
        # NOTE: the layer choice holds through the capture too: dynamo checks it on every call
        # of the compiled forward, and a changed choice would recompile inside the capture.
        layers = traced_layers(self.model, self.compile_layers if compiled else "kernels")
        # Warm up first (Triton and torch.compile compile, the allocator settles).
        self.stream.wait_stream(torch.cuda.current_stream())
        with layers, torch.cuda.stream(self.stream):
            t0 = time.perf_counter()
            for _ in range(2):
                self._run_model(fb)
            self.stream.synchronize()
            warm_s = time.perf_counter() - t0
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.logits[bs] = self._run_model(fb)
            finally:
                graph.capture_end()  # raises when the capture was invalidated
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graphs[bs] = graph
        self.batches[bs] = fb
        return warm_s if compiled else 0.0

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch. A view of the graph's output buffer: it is
        overwritten by the next replay."""
        bs = fb.batch_size
        size = next(s for s in self.capture_sizes if s >= bs)
        if size > bs:
            self.input_ids[bs:size].zero_()
            self.positions[bs:size].zero_()
            self.out_cache_loc[bs:size].zero_()
            self.req_pool_indices[bs:size].zero_()
            self.seq_lens[bs:size].fill_(1)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.ctx.attn_backend.init_forward_metadata_replay(self.batches[size], self.max_context_len)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:bs]


def capture_graphs(
    model: DecodeModel,
    ctx: ForwardContext,
    device: torch.device,
    max_bs: int,
    max_context_len: int,
    compile_config: EngineConfig | None = None,
) -> CudaGraphRunner | None:
    """Capture the decode graphs; on failure log a warning and return None (decode runs eagerly).
    With `compile_config`, a failure is first retried without torch.compile.

    A failed capture leaves the default CUDA generators in capture mode (PyTorch ends their
    capture only after a successful one), which breaks every later random draw in the process;
    their states are restored from copies taken before. If the device itself is broken after the
    failure, raise CaptureError instead.
    """
    generators = list(torch.cuda.default_generators)
    saved = [g.clone_state() for g in generators]
    attempts = [compile_config, None] if compile_config is not None else [None]
    for config in attempts:
        try:
            return CudaGraphRunner(model, ctx, device, max_bs, max_context_len, config)
        except Exception as e:
            for gen, state in zip(generators, saved, strict=True):
                gen.graphsafe_set_state(state)
            try:
                torch.cuda.synchronize(device)
            except Exception as sticky:
                raise CaptureError(f"a failed graph capture left the GPU unusable: {e}") from sticky
            if config is not None:
                logger.warning("torch.compile of the decode graphs failed, captured without: %s", e)
            else:
                logger.warning("CUDA graph capture failed, decode runs without graphs: %s", e)
    return None
