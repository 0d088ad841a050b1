"""The model runner owns every device tensor: weights, the request-to-token table, the KV pool,
the attention backend. It turns a tensor-free `ScheduledBatch` into a `ForwardBatch` and runs it.

With `tp_size > 1` the runner built by the engine is rank 0 of a tensor-parallel group: it starts
ranks 1..N-1 as worker processes (engine/distributed/workers.py), each with its own runner, and
hands them every batch before running its own share; its logits are the full (all-gathered) ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Iterator

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.distributed.workers import READY_TIMEOUT_S, TPWorkers, WorkerError, start_tp_group
from engine.executor.compile import CompiledDecode
from engine.executor.cuda_graph_runner import CudaGraphRunner, capture_graphs
from engine.executor.device import resolve_device, resolve_dtype
from engine.executor.device_lock import DEVICE_LOCK
from engine.executor.launched_step import LaunchedStep, SampleRequest, StepOutput
from engine.executor.loader import load_weights
from engine.executor.tp_worker import check_tp_split, worker_main
from engine.forward_batch import ForwardBatch, ForwardContext
from engine.kernels.launch import mark_warm
from engine.kernels.utils import cdiv
from engine.layers.attention.base import AttentionBackend
from engine.layers.attention.registry import make_attention_backend
from engine.layers.sampler import (
    SampleOutput,
    Sampler,
    SamplingBatchInfo,
    argmax_suffices,
    first_argmax,
    host_to_device,
    make_generator,
)
from engine.mem_cache.kv_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool
from engine.models.registry import build_model
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
# The attributes that hold device memory, directly or through what they own (the graph runner:
# its graphs, their memory pool and the compiled forward; the compiled decode: its dynamo
# code): `shutdown()` drops them.
DEVICE_STATE = (
    "graph_runner",
    "compiled_decode",
    "ctx",
    "attn_backend",
    "kv_pool",
    "req_to_token",
    "model",
)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


PACK_ALIGN = 2  # int64 elements: each field of the packed copy starts 16 bytes aligned


def pack_int64(fields: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The fields as int64 tensors on `device`, from one host-to-device copy (pinned on CUDA).

    Each field starts on a 16-byte boundary (zeros pad the one before it): Triton specializes a
    pointer argument on whether it is 16-byte aligned, and with fields packed end to end the
    alignment of, say, seq_lens followed the parity of the batch's token count, so a kernel met
    a variant its warm-up had not built (a 1 s compile mid-serving on the H200).
    """
    sizes = [len(f) for f in fields]
    padded = [cdiv(n, PACK_ALIGN) * PACK_ALIGN for n in sizes]
    flat: list[int] = []
    for f, n, size in zip(fields, sizes, padded, strict=True):
        flat += f
        flat += [0] * (size - n)
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    parts = host.to(device, non_blocking=True).split(padded)
    return [part[:n] for part, n in zip(parts, sizes, strict=True)]


def check_context_len(config: EngineConfig, mc: ModelConfig) -> None:
    """Raise ConfigError if max_context_len asks for positions the model was not trained on
    (as vLLM refuses a max_model_len above the model's): RoPE past max_position_embeddings
    extrapolates, and the output degrades without any error."""
    limit = mc.max_position_embeddings
    if config.max_context_len is not None and config.max_context_len > limit:
        raise ConfigError(
            f"max_context_len {config.max_context_len} is above the model's "
            f"max_position_embeddings {limit}; set max_context_len to {limit} or less"
        )


class ModelRunner:
    """One rank's model, KV pool and request table.

    `parallel` is given only to the runners of worker processes (ranks >= 1). Without it, a
    config with tp_size > 1 makes this runner rank 0: it starts the workers, and `shutdown()`
    (or garbage collection, or process exit) stops them.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        parallel: ParallelState | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config or ModelConfig.from_pretrained(config.model)
        check_context_len(config, self.model_config)
        self.device = resolve_device(config.device, parallel.rank if parallel else 0)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.workers: TPWorkers | None = None
        if parallel is None and config.tp_size > 1:
            check_tp_split(self.model_config, config.tp_size)  # before starting any process
            target = functools.partial(worker_main, ModelRunner)  # pickled by reference
            self.workers, parallel = start_tp_group(config, self.device, target)
            weakref.finalize(self, self.workers.shutdown)
        self.parallel = parallel or ParallelState()
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own generators
        # The ids sampled by the latest launched step, on the device: placeholder input ids of
        # the next step are read from here (`_resolve_placeholders`).
        self._last_sampled: torch.Tensor | None = None
        mark_warm(False)  # this engine's warm-up compiles are not late (engine.kernels.launch)
        try:
            with DEVICE_LOCK:  # seeds, builds and captures: no other engine's step meanwhile
                self._init_model_and_memory()
        except BaseException as e:
            # A worker that failed (out of memory on its GPU, ...) reports why; rank 0 saw only
            # a collective that broke.
            report = self.workers.error_report() if self.workers is not None else None
            self.shutdown()
            if report is not None:
                raise WorkerError(report) from e
            raise

    def _init_model_and_memory(self) -> None:
        config = self.config
        torch.manual_seed(config.seed)
        mc = self.model_config
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = build_model(mc, self.parallel)
        self.model.to(self.device)  # buffers made from CPU tensors (RoPE frequencies)
        self.model.set_absorbed_weight_dtype(config.absorbed_weight_dtype, self.device)
        load_weights(self.model, mc.path, mc.num_hidden_layers)
        self.model.eval()

        # Every rank's pool must have the same slots: the scheduler on rank 0 hands them out.
        page = config.page_size
        self.max_total_tokens = self.parallel.min_int(self._kv_slots(), self.device) // page * page
        self.max_context_len = min(
            config.max_context_len or mc.max_position_embeddings, self.max_total_tokens
        )
        # Row r of req_to_token maps position i of the request in row r to its KV slot.
        self.max_running_requests = config.max_running_requests
        self.req_to_token = torch.zeros(
            self.max_running_requests, self.max_context_len, dtype=torch.int32, device=self.device
        )
        self.kv_pool = self._make_kv_pool(self.max_total_tokens)
        self.attn_backend: AttentionBackend = make_attention_backend(
            config.attention_backend,
            self.kv_pool,
            self.device,
            config.mla_decode_kernel,
            num_heads=self.parallel.shard(mc.num_attention_heads, "attention heads")[1],
        )
        self.ctx = ForwardContext(self.req_to_token, self.kv_pool, self.attn_backend)
        self.graph_runner: CudaGraphRunner | None = None
        if self._use_cuda_graph():
            self.graph_runner = capture_graphs(
                self.model,
                self.ctx,
                self.device,
                min(config.cuda_graph_max_bs, self.max_running_requests),
                self.max_context_len,
                self._compile_config(),
            )
        # torch.compile without graphs (CPU, or graphs off): the decode forward is called as is.
        self.compiled_decode: CompiledDecode | None = None
        compile_config = self._compile_config() if self.graph_runner is None else None
        if compile_config is not None:
            traceable = self.attn_backend.traceable
            self.compiled_decode = CompiledDecode(
                self.model, compile_config, traceable, self.max_context_len
            )
        if self.workers is not None:
            self.workers.wait("ready", READY_TIMEOUT_S)
        # Rank 0 only: its forwards drive the workers' (a worker warming up on its own would wait
        # in a collective for rank 0, which waits for the workers' "ready").
        if self.device.type == "cuda" and self.parallel.rank == 0:
            self.warm_up_prefill()
            mark_warm()  # a Triton compile from here on is logged (engine.kernels.launch)

    def warm_up_prefill(self) -> None:
        """Run dummy prefills of the chunk size, then a quarter of it, ... down to 16 tokens.

        Triton compiles a kernel the first time it meets a new tile configuration, and the
        prefill kernels choose theirs by size (the fused MoE by tokens per expert): without
        this, the first prompts of each size class wait seconds for the compiler (a TTFT p99 of
        8.8 s at 16 concurrent requests in the first GPU serving run). Each size runs twice: one
        request of the odd size, then a batch of two whose sizes are multiples of 16, the second
        behind a cached prefix (the context-gathering path), for the variants that remain by
        argument (the batch-sized ints are not specialized: engine.kernels.launch). The tokens
        go to the reserved slot 0 and request rows 0 and 1, which no request holds yet.
        """
        t0 = time.perf_counter()
        sizes: list[int] = []
        size = min(self.config.chunked_prefill_size, self.max_context_len - 1)
        while size >= 16:
            sizes.append(size)
            size //= 4
        prefix = 16
        for n in sizes:
            batch = ScheduledBatch(ForwardMode.EXTEND, [BatchEntry(0, [0] * n, 0, [0] * n)])
            first_argmax(self.forward(batch))  # the greedy draw's kernels too
            half = max(16, n // 2 // 16 * 16)
            if half + prefix >= self.max_context_len or self.max_running_requests < 2:
                continue
            pair = [
                BatchEntry(0, [0] * half, 0, [0] * half),
                BatchEntry(1, [0] * half, prefix, [0] * half, prefix_slots=[0] * prefix),
            ]
            self.forward(ScheduledBatch(ForwardMode.EXTEND, pair))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "prefill warm-up (%s tokens, each also as two requests) in %.1f s",
            ", ".join(map(str, sizes)), time.perf_counter() - t0,
        )  # fmt: skip

    def device_error(self) -> str | None:
        """Why this rank's GPU can run nothing more (a sticky CUDA error such as an illegal
        address or a device-side assert: every later call on the context fails), or None."""
        if self.device.type != "cuda":
            return None
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            return f"the GPU is in an error state ({e}); the engine must be restarted"
        return None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (rank 0) and release this rank's device memory: the
        weights, the KV pool, the CUDA graphs and their memory pool, the compiled forward. The
        runner serves no batch afterwards. Idempotent.

        NOTE: the memory goes even while something still holds the runner (a caller's local,
        a traceback): the next engine of the process sizes its KV pool from the free memory.
        """
        if self.workers is not None:
            self.workers.shutdown()
        self.parallel.close()
        with DEVICE_LOCK:  # after a step in flight on another thread (AsyncEngine's loop)
            for name in DEVICE_STATE:
                vars(self).pop(name, None)
            self._generators.clear()
            self._last_sampled = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, for the next engine or process

    # ---- set-up -------------------------------------------------------------------------------
    def _make_kv_pool(self, size: int) -> KVPool:
        mc, cfg = self.model_config, self.config
        if mc.is_mla:
            return MLATokenToKVPool(
                size,
                mc.num_hidden_layers,
                mc.kv_lora_rank,
                mc.qk_rope_head_dim,
                self.dtype,
                self.device,
                cfg.kv_cache_dtype,
                cfg.page_size,
            )
        # Each rank stores only its KV heads (MLA's latent rows are whole on every rank).
        kv_heads = self.parallel.shard(mc.num_key_value_heads, "KV heads")[1]
        return MHATokenToKVPool(
            size,
            mc.num_hidden_layers,
            kv_heads,
            mc.head_dim,
            mc.head_dim,
            self.dtype,
            self.device,
            cfg.kv_cache_dtype,
            cfg.page_size,
        )

    def _use_cuda_graph(self) -> bool:
        """Graphs need CUDA and the Triton backend (the torch-native one syncs with the host).

        With tensor parallelism only when `cuda_graph_with_tp`: every rank builds its runner at
        the same time and captures the same sizes in the same order (their KV pools and limits
        agree), so the collectives inside the captures meet; each step every rank replays the
        same size for the same batch (`can_run` reads only the batch), after the placeholder
        broadcast, which stays outside the graphs.
        """
        cfg = self.config
        if not cfg.enable_cuda_graph or cfg.cuda_graph_max_bs < 1 or self.device.type != "cuda":
            return False
        if not self.attn_backend.supports_cuda_graph:
            logger.info(
                "CUDA graphs off: the %s backend does not support them", cfg.attention_backend
            )
            return False
        if self.parallel.world_size > 1 and not cfg.cuda_graph_with_tp:
            logger.info("CUDA graphs off with tp_size > 1 (cuda_graph_with_tp turns them on)")
            return False
        return True

    def _compile_config(self) -> EngineConfig | None:
        """The config when the decode forward is to be compiled, else None. With tensor
        parallelism every rank compiles the same sizes; the collectives trace as custom ops
        (engine/distributed/parallel_state.py)."""
        return self.config if self.config.enable_torch_compile else None

    def _kv_slots(self) -> int:
        """How many token slots the KV pool gets: configured, or what fits in device memory."""
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        if self.device.type != "cuda":
            return CPU_DEFAULT_MAX_TOTAL_TOKENS
        probe = self._make_kv_pool(1)
        per_token = probe.bytes_per_token()
        del probe
        # Memory that PyTorch's allocator still caches (an engine of this process that was
        # dropped without shutdown()) is free to us, but mem_get_info counts it as used.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1.0 - self.config.mem_fraction)
        slots = int(budget // per_token)
        if slots < 16:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free, "
                f"mem_fraction={self.config.mem_fraction}"
            )
        logger.info("KV cache: %d slots (%.1f GiB)", slots, slots * per_token / 2**30)
        return slots

    # ---- forward ------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        positions: list[int] = []
        input_ids: list[int] = []
        seq_lens: list[int] = []
        for e in batch.entries:
            n = len(e.input_ids)
            if e.prefix_slots is not None:
                rows += [e.req_pool_idx] * e.prefix_len
                cols += range(e.prefix_len)
                vals += e.prefix_slots
            rows += [e.req_pool_idx] * n
            cols += range(e.prefix_len, e.prefix_len + n)
            vals += e.out_cache_loc
            positions += range(e.prefix_len, e.prefix_len + n)
            input_ids += e.input_ids
            seq_lens.append(e.prefix_len + n)
        extend_lens = [len(e.input_ids) for e in batch.entries]
        # NOTE: every integer input travels in one host-to-device copy (pinned on CUDA, so it
        # does not wait for the copy engine): a decode step is otherwise a dozen small copies.
        fields = [
            input_ids,
            positions,
            [s for e in batch.entries for s in e.out_cache_loc],
            [e.req_pool_idx for e in batch.entries],
            seq_lens,
            extend_lens,
            rows,
            cols,
            vals,
        ]
        packed = pack_int64(fields, self.device)
        ids, pos, out_loc, req_rows, lens, ext_lens, t_rows, t_cols, t_vals = packed
        if input_ids and min(input_ids) < 0:
            ids = self._resolve_placeholders(ids)
        self.req_to_token[t_rows, t_cols] = t_vals.to(torch.int32)
        fb = ForwardBatch.build(
            batch.mode,
            self.ctx,
            input_ids=ids,
            positions=pos,
            out_cache_loc=out_loc,
            req_pool_indices=req_rows,
            seq_lens=lens,
            extend_lens=ext_lens,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=[e.prefix_len for e in batch.entries],
            extend_lens_cpu=extend_lens,
        )
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run the batch; return float32 logits of each request's last token [B, V], or of every
        input token [T, V] when `all_logits`."""
        assert batch.mode == ForwardMode.DECODE or batch.num_tokens > 0
        with DEVICE_LOCK:
            if self.workers is None:
                return self._forward(batch, all_logits)
            self.workers.send(batch, all_logits)
            try:
                return self._forward(batch, all_logits)
            except Exception as e:
                report = self.workers.error_report(timeout=1.0)
                if report is not None:
                    raise WorkerError(report) from e
                raise

    def _forward(self, batch: ScheduledBatch, all_logits: bool) -> torch.Tensor:
        """`forward`'s work on this rank (under DEVICE_LOCK, the workers already sent it)."""
        fb = self.prepare(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)  # decode: one token, so last = all
        if self.compiled_decode is not None and self.compiled_decode.can_run(fb):
            return self.compiled_decode.run(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if not all_logits:
            hidden = hidden[fb.extend_lens.cumsum(0) - 1]  # each request's last token
        return self.model.compute_logits(hidden)

    def _resolve_placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        """Input id -(k + 1) is the k-th token sampled by the latest launched step, whose value
        the host does not know yet (the overlap schedule): read it on the device.

        NOTE: with tensor parallelism only rank 0 samples, so only it holds those ids. It
        resolves them and broadcasts the batch's input ids to the other ranks, on the device and
        in stream order (NCCL's wait makes the compute stream wait, not the host), before every
        rank embeds them. Chosen over broadcasting the sampled ids after each sampling: only
        steps that read a placeholder pay for it, the broadcast's size (the batch's tokens) is
        in the message every rank already has, and unseeded sampling needs no generators kept
        in lockstep across ranks (a sampler run on every rank would).
        """
        if self.parallel.rank == 0:
            assert self._last_sampled is not None, "a placeholder input id, but no sampled step"
            future = self._last_sampled[(-ids - 1).clamp_min(0)]
            ids = torch.where(ids < 0, future, ids)
        return self.parallel.broadcast(ids, src=0)

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, sample_rows: list[int], requests: list[SampleRequest]
    ) -> LaunchedStep:
        """Queue the batch and the drawing of the next token of the rows in `sample_rows` (a
        prefill chunk that does not end its prompt samples nothing) on the device, and return
        without waiting for them; `requests[i]` describes row `sample_rows[i]`. The batch may
        hold placeholders for the tokens of the step launched before it."""
        with DEVICE_LOCK:
            t0 = time.perf_counter()
            started = None
            if self.device.type == "cuda":
                started = torch.cuda.Event(enable_timing=True)
                started.record(torch.cuda.current_stream(self.device))
            logits = self.forward(batch)
            chosen = None
            if sample_rows:
                if sample_rows != list(range(logits.shape[0])):  # decode: every row, in order
                    rows = host_to_device(sample_rows, torch.int64, logits.device)
                    logits = logits[rows]
                chosen = self._sample(logits, requests)
            self._last_sampled = None if chosen is None else chosen.next_token_ids
            return LaunchedStep(self.device, chosen, started, t0)

    def forward_and_sample(
        self, batch: ScheduledBatch, sample_rows: list[int], requests: list[SampleRequest]
    ) -> StepOutput:
        """`launch`, then wait for its result."""
        return self.launch(batch, sample_rows, requests).result()

    def release_request(self, rid: str) -> None:
        """Forget a finished request's sampling state (its seeded generator)."""
        self._generators.pop(rid, None)

    def _sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> SampleOutput:
        if all(argmax_suffices(r.params, r.suppressed_ids) for r in requests):
            return SampleOutput(first_argmax(logits), None)
        generators: list[torch.Generator | None] = []
        for r in requests:
            gen = self._generators.get(r.rid)
            if gen is None and r.params.seed is not None:
                gen = self._generators[r.rid] = make_generator(r.params.seed, self.device)
            generators.append(gen)
        suppressed = [r.suppressed_ids for r in requests]
        info = SamplingBatchInfo.from_params(
            [r.params for r in requests],
            generators,
            logits.device,
            suppressed if any(suppressed) else None,
        )
        if not info.penalized_rows:
            return self.sampler(logits, info)
        history = [r.history for r in requests]
        return self.sampler(logits, info, history, [r.prompt_len for r in requests])
