"""The models with every layer kernel forced on (RMSNorm, SiLU-and-multiply, router, fused MoE,
MLA preamble; under the interpreter on CPU) against the same models on the torch code.

The kernels are wired in by each module's `kernel` attribute ("auto": Triton on CUDA only), so
this checks the wiring (argument order, shapes, strides, the residual stream) end to end.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.executor.model_runner import ModelRunner
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

CASES = {
    "v2-lite-like": dict(arch="v2", q_lora_rank=None, yarn=True),
    "v3": dict(arch="v3", q_lora_rank=24),
}
ATOL = 1e-4


def force_kernels(model: nn.Module, kernel: str) -> int:
    """Set every module's kernel choice; returns how many modules have one."""
    found = [m for m in model.modules() if isinstance(getattr(m, "kernel", None), str)]
    for m in found:
        m.kernel = kernel  # type: ignore[assignment]
    return len(found)


def _logits(path: str, kernel: str, prompt: list[int], steps: int) -> list[torch.Tensor]:
    runner = ModelRunner(
        EngineConfig(
            model=path, dtype="float32", attention_backend="torch_native", max_total_tokens=128
        )
    )
    assert force_kernels(runner.model, kernel) > 0
    out = []
    entry = BatchEntry(0, prompt, 0, list(range(1, len(prompt) + 1)))
    logits = runner.forward(ScheduledBatch(ForwardMode.EXTEND, [entry]), all_logits=True).cpu()
    out.append(logits)
    n = len(prompt)
    for i in range(steps):
        token = [(31 * i + 5) % 1000 + 10]
        entry = BatchEntry(0, token, n, [n + 1], prefix_slots=list(range(1, n + 1)))
        out.append(runner.forward(ScheduledBatch(ForwardMode.DECODE, [entry])).cpu())
        n += 1
    return out


@pytest.mark.parametrize("case", [*CASES, "llama"])
def test_layer_kernels_match_torch_path(case: str, request: pytest.FixtureRequest) -> None:
    if case == "llama":
        path = request.getfixturevalue("tiny_llama")
    else:
        opts = dict(CASES[case])
        path = request.getfixturevalue("tiny_mla")(opts.pop("arch"), moe=True, **opts)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(9)]
    native = _logits(path, "native", prompt, steps=3)
    triton = _logits(path, "triton", prompt, steps=3)
    assert native[0].abs().max().item() > 1.0, "random weights too small to test anything"
    for a, b in zip(native, triton, strict=True):
        assert (a - b).abs().max().item() < ATOL
