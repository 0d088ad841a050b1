"""The engine's models against Hugging Face transformers on the same weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)

from engine import LLM, EngineConfig, SamplingParams
from engine.executor.model_runner import ModelRunner
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

# The reference-precision path: float32 and the torch-native backend (the Triton kernels use TF32
# dots on a GPU; tests/test_triton_backend.py holds them to the torch-native backend).
REFERENCE = dict(dtype="float32", attention_backend="torch_native", max_total_tokens=256)

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a Python function that reverses a string.",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the mountains,",
    "def fibonacci(n):\n",
    "Paris is a city that",
    "1, 2, 3, 5, 8, 13,",
]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def hf_default(default_model: str):
    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


def test_default_model_greedy_matches_transformers(default_model: str, hf_default) -> None:
    llm = LLM(default_model, **{**REFERENCE, "max_total_tokens": 8192}, debug_checks=True)
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in CHAT_QUESTIONS
    ] + RAW_PROMPTS
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params)
    assert len(prompts) >= 10
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_default.generate(
                ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.eos_token_id
            )[0, ids.shape[1] :].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == ref, f"prompt {prompt!r}: {out.text!r}"
        assert out.text == tok.decode(ref, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if len(ref) < MAX_NEW_TOKENS else "length")
    assert outs[0].text == "The capital of France is Paris."


def test_default_model_logprobs_match_transformers(default_model: str, hf_default) -> None:
    """Greedy with 5 top tokens a step: each chosen token's logprob and rank, and the top
    tokens and their logprobs, against transformers' scores of the same continuation."""
    llm = LLM(default_model, **REFERENCE)
    prompt = RAW_PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=5))[0]
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        logits = hf_default(ids).logits[0, len(out.prompt_token_ids) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    ref_top = torch.topk(ref, 5, dim=-1)
    assert out.logprobs is not None and out.logprob_ranks is not None
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids) == 8
    for step, token in enumerate(out.token_ids):
        assert out.logprobs[step] == pytest.approx(ref[step, token].item(), abs=1e-4)
        assert out.logprob_ranks[step] == 1  # greedy
        top_ids = [t for t, _ in out.top_logprobs[step]]
        assert top_ids[0] == token
        assert top_ids == ref_top.indices[step].tolist()
        got = torch.tensor([p for _, p in out.top_logprobs[step]])
        torch.testing.assert_close(got, ref_top.values[step], atol=1e-4, rtol=0)
    chosen_only = llm.generate([prompt], SamplingParams(max_tokens=3, logprobs=True, seed=1))[0]
    assert chosen_only.top_logprobs is None and chosen_only.logprob_ranks is not None
    assert all(rank >= 1 for rank in chosen_only.logprob_ranks)


MLA_CASES = {
    "v2-lite-like": dict(arch="v2", q_lora_rank=None, yarn=True),
    "v2-q-lora": dict(arch="v2", q_lora_rank=24),
    "v3": dict(arch="v3", q_lora_rank=24),
    "v3-no-q-lora": dict(arch="v3", q_lora_rank=None, yarn=True),
}
PREFILL_ATOL = 1e-4
DECODE_STEPS = 20


def _run(runner: ModelRunner, mode: ForwardMode, ids: list[int], prefix: int, all_logits: bool):
    slots = list(range(prefix + 1, prefix + len(ids) + 1))  # the request owns slots 1..n
    entry = BatchEntry(0, ids, prefix, slots, prefix_slots=list(range(1, prefix + 1)))
    return runner.forward(ScheduledBatch(mode, [entry]), all_logits=all_logits).cpu()


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_logits_match_transformers(tiny_mla, case: str) -> None:
    opts = dict(MLA_CASES[case])
    path = tiny_mla(opts.pop("arch"), moe=True, **opts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=path, **REFERENCE))
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(23)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    # Prefill: the decompressing path.
    logits = _run(runner, ForwardMode.EXTEND, prompt, 0, all_logits=True)
    assert (logits - ref).abs().max().item() < PREFILL_ATOL
    assert ref.abs().max().item() > 1.0, "random weights too small to test anything"
    # Decode: the absorbed path, one token at a time over the latent cache.
    seq = list(prompt)
    token = int(logits[-1].argmax())
    for _ in range(DECODE_STEPS):
        seq.append(token)
        step = _run(runner, ForwardMode.DECODE, [token], len(seq) - 1, all_logits=False)[0]
        with torch.no_grad():
            ref_step = hf(torch.tensor([seq])).logits[0, -1]
        assert (step - ref_step).abs().max().item() < PREFILL_ATOL
        token = int(step.argmax())


@pytest.mark.parametrize("case", ["v2-lite-like", "v3"])
def test_mla_absorbed_and_decompressed_paths_agree(tiny_mla, case: str) -> None:
    opts = dict(MLA_CASES[case])
    path = tiny_mla(opts.pop("arch"), moe=True, **opts)
    runner = ModelRunner(EngineConfig(model=path, **REFERENCE))
    prompt = list(range(100, 140))
    # A cached prefix of 25 tokens, then 15 new tokens, through each path.
    _run(runner, ForwardMode.EXTEND, prompt[:25], 0, all_logits=False)
    decompressed = _run(runner, ForwardMode.EXTEND, prompt[25:], 25, all_logits=True)
    runner.model.set_absorb_extend(True)  # type: ignore[attr-defined]
    absorbed = _run(runner, ForwardMode.EXTEND, prompt[25:], 25, all_logits=True)
    assert (absorbed - decompressed).abs().max().item() < PREFILL_ATOL
    # The stored latent rows are the same whichever path wrote them.
    pool = runner.kv_pool
    row = runner.model_config.kv_cache_dim
    assert pool.get_kv(0, torch.arange(1, 41, device=runner.device))[0].shape == (40, 1, row)


def test_mla_pool_stores_latent_not_full_kv(tiny_mla) -> None:
    path = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    runner = ModelRunner(EngineConfig(model=path, dtype="float32", max_total_tokens=64))
    mc = runner.model_config
    per_token = runner.kv_pool.bytes_per_token()
    assert per_token == mc.num_hidden_layers * (mc.kv_lora_rank + mc.qk_rope_head_dim) * 4
    full_kv = mc.num_hidden_layers * mc.num_attention_heads * (mc.head_dim + mc.v_head_dim) * 4
    assert per_token < full_kv


class _CountPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties over the generated ids, for transformers."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for tok, count in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, tok] -= self.presence + self.frequency * count
        return scores


def test_presence_and_frequency_penalties_match_transformers(
    default_model: str, hf_default
) -> None:
    """Greedy with vLLM's presence and frequency penalties (and a repetition penalty before
    them) through the engine, against transformers' generate with the same rule."""
    llm = LLM(default_model, **{**REFERENCE, "max_total_tokens": 4096})
    tok = llm.tokenizer
    prompts = ["1, 2, 3, 5, 8, 13,", "The quick brown fox jumps over the lazy dog. The quick"]
    for presence, frequency, repetition in [(0.5, 0.7, 1.0), (-0.3, 1.2, 1.15)]:
        params = SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=presence,
            frequency_penalty=frequency, repetition_penalty=repetition,
        )  # fmt: skip
        plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
        for prompt, out, base in zip(prompts, llm.generate(prompts, params), plain, strict=True):
            ids = tok(prompt, return_tensors="pt").input_ids
            processors = LogitsProcessorList(
                [RepetitionPenaltyLogitsProcessor(repetition)] if repetition != 1.0 else []
            )
            processors.append(_CountPenalties(ids.shape[1], presence, frequency))
            with torch.no_grad():
                ref = hf_default.generate(
                    ids, do_sample=False, max_new_tokens=24, min_new_tokens=24,
                    logits_processor=processors, pad_token_id=tok.eos_token_id,
                )[0, ids.shape[1] :].tolist()  # fmt: skip
            assert out.token_ids == ref, f"{prompt!r}: {out.text!r}"
            assert out.token_ids != base.token_ids  # the penalties changed the text
