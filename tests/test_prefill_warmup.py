"""The model runner's prefill warm-up (run at start-up on CUDA so that Triton compiles the
prefill kernels' tile configurations before the first requests): it leaves no trace in what
requests get afterwards."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_prefill_warm_up_leaves_outputs_unchanged(
    which: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    prompts = [[100 + (i * 37 + j * 11) % 5000 for j in range(3 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    common = dict(
        dtype="float32", max_total_tokens=2048, chunked_prefill_size=64, debug_checks=True
    )
    expected = [o.token_ids for o in LLM(model, **common).generate(prompts, params)]

    llm = LLM(model, **common)
    with caplog.at_level(logging.INFO, logger="engine.executor.model_runner"):
        llm.core.runner.warm_up_prefill()
    assert "prefill warm-up (64, 16 tokens, each also as two requests)" in caplog.text
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    llm.core.scheduler.check_integrity()
    assert llm.core.scheduler.num_running == 0
