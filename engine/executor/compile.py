"""torch.compile of the decode forward (SGLang's `enable_torch_compile`).

What is compiled: the model forward and its logits for decode batches of up to
`torch_compile_max_bs` requests, one graph per batch size (`dynamic=False`: every shape is a
constant, so inductor sizes its kernels for that batch). On CUDA the compiled forward is what the
CUDA graph of that size captures (`cuda_graph_runner.py` warms it up, which compiles it, then
captures it); on other devices `CompiledDecode` calls it directly, compiling each batch size on
first use.

The Triton kernels are custom ops (`engine/kernels/custom_ops.py`), so the Triton attention
backend's decode and KV store trace into one graph; a backend that cannot be traced (the
torch-native one) runs eagerly between compiled pieces. `torch_compile_layers` chooses what the
norms, activation, RoPE, MLA preamble and MoE router run inside the compiled forward: "native"
switches them to their torch code for the trace (SGLang's `_to_torch`), so inductor fuses them
with their neighbours; "kernels" keeps the hand-written kernels as opaque ops.

Inductor's cache directory (`torch_compile_cache_dir`, default ~/.cache/mla-engine/inductor)
keeps the generated code between runs, so a restart mostly loads instead of compiling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Dynamo keeps one compiled graph per batch size (and per engine in a process of several): far
# more than its default limit of 8 recompilations of one function.
RECOMPILE_LIMIT = 1024

DecodeForward = Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mla-engine" / "inductor"


def inductor_cache_dir(config: EngineConfig, environ: dict[str, str] | None = None) -> Path:
    """The configured directory, else $TORCHINDUCTOR_CACHE_DIR, else `default_cache_dir()`."""
    environ = dict(os.environ) if environ is None else environ
    if config.torch_compile_cache_dir:
        return Path(config.torch_compile_cache_dir).expanduser()
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    return default_cache_dir()


def configure_compiler(config: EngineConfig) -> Path:
    """Point inductor at its cache directory and raise dynamo's recompilation limits; returns
    the cache directory. Process-wide settings (the same for every engine of the process)."""
    cache = inductor_cache_dir(config)
    cache.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(cache)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True  # compiled graphs are saved in the cache directory
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, RECOMPILE_LIMIT
    )
    return cache


def decode_forward(model: Any) -> DecodeForward:
    """The function that is compiled: the forward and the float32 logits of a decode batch."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, fb))

    return forward


def compile_decode_forward(model: Any, config: EngineConfig, traceable: bool) -> DecodeForward:
    """torch.compile of `decode_forward(model)`. `traceable`: the attention backend traces into
    the graph, so the whole forward must be one graph (`fullgraph`: a break is an error, not a
    silent slowdown)."""
    configure_compiler(config)
    options: dict[str, Any] = dict(dynamic=False, fullgraph=traceable)
    if config.torch_compile_backend == "inductor" and config.torch_compile_mode != "default":
        options["mode"] = config.torch_compile_mode
    return torch.compile(decode_forward(model), backend=config.torch_compile_backend, **options)


def layer_kernel_modules(model: Any) -> list[nn.Module]:
    """The modules that choose between a Triton kernel and their torch code (a `kernel`
    attribute), except the routed experts: their torch code loops over experts on the host,
    so they always run the fused MoE kernel."""
    from engine.layers.moe import Experts

    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "kernel", None), str) and not isinstance(m, Experts)
    ]


@contextlib.contextmanager
def traced_layers(model: Any, layers: str) -> Iterator[None]:
    """While tracing with torch_compile_layers="native": the layers that are on "auto" run
    their torch code (inductor fuses it); their choice is restored afterwards. A compiled graph
    keeps the choice it was traced with, so this only has to hold while compiling (and, without
    CUDA graphs, whenever the compiled forward runs: dynamo checks the attribute)."""
    switched: list[nn.Module] = []
    if layers == "native":
        switched = [m for m in layer_kernel_modules(model) if m.kernel == "auto"]
    for m in switched:
        setattr(m, "kernel", "native")  # noqa: B010 (an attribute nn.Module's typing hides)
    try:
        yield
    finally:
        for m in switched:
            setattr(m, "kernel", "auto")  # noqa: B010


class CompiledDecode:
    """The compiled decode forward without CUDA graphs (CPU, or CUDA with graphs off): decode
    batches of up to `max_bs` requests run it; each new batch size is compiled on first use.

    With a traceable backend the attention metadata is set as for a graph (its hooks) for the
    next power of two of the batch's longest context: the split-KV count the kernels get is a
    constant of the compiled graph, so a new one would compile again at every step.
    """

    def __init__(
        self, model: nn.Module, config: EngineConfig, traceable: bool, max_context_len: int
    ) -> None:
        self.model = model
        self.max_bs = config.torch_compile_max_bs
        self.layers = config.torch_compile_layers
        self.traceable = traceable
        self.max_context_len = max_context_len
        self.forward = compile_decode_forward(model, config, traceable)
        self.compiled_sizes: set[int] = set()
        self.calls = 0  # decode steps served (for tests)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch (after the backend's `init_forward_metadata`)."""
        if self.traceable and fb.attn_backend.supports_cuda_graph:
            longest = max(fb.seq_lens_cpu)
            bucket = min(1 << (longest - 1).bit_length(), self.max_context_len)
            fb.attn_backend.init_forward_metadata_capture(fb, bucket)
        first = fb.batch_size not in self.compiled_sizes
        t0 = time.perf_counter()
        with traced_layers(self.model, self.layers):
            logits = self.forward(fb.input_ids, fb.positions, fb)
        if first:
            self.compiled_sizes.add(fb.batch_size)
            logger.info(
                "torch.compile: the decode forward of batch size %d compiled in %.1f s",
                fb.batch_size,
                time.perf_counter() - t0,
            )
        self.calls += 1
        return logits
