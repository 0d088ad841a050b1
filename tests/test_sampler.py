"""Sampler: greedy exactness, filters against transformers' warpers, seeds, distributions."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    apply_count_penalties,
    apply_repetition_penalty,
    filter_probs,
    make_generator,
)
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[list[int]] | None = None,
    device: torch.device = CPU,
) -> torch.Tensor:
    gens = [make_generator(p.seed, device) if p.seed is not None else None for p in params]
    info = SamplingBatchInfo.from_params(params, gens, device)
    return Sampler()(logits.to(device), info, history).next_token_ids


def test_greedy_is_exact_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1.0  # tie: first index wins, like argmax
    out = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[2].item() == 10


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    expected = logits.argmax(dim=-1)
    for _ in range(5):
        assert torch.equal(run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8), expected)
        assert torch.equal(run(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8), expected)


def test_a_tiny_temperature_is_greedy() -> None:
    """Below 1e-5 (vLLM's bound) a temperature samples as greedy: logits / T would overflow
    float32 (a 1e-39 temperature drew token 0 whatever the logits)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    for t in (1e-39, 1e-50, 1e-6):
        assert SamplingParams(temperature=t).is_greedy
        assert run(logits, [SamplingParams(temperature=t)]).item() == 1


def test_top_k_keeps_the_tokens_tied_with_the_kth() -> None:
    """Tokens tied with the k-th largest stay (as transformers' and vLLM's top-k): bf16 logits
    tie often, and a cut at rank k would always drop the higher ids."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0]])
    info = SamplingBatchInfo.from_params([SamplingParams(top_k=2)], [None], CPU)
    kept = filter_probs(torch.softmax(logits, -1), info)[0] > 0
    assert kept.tolist() == [True, True, True, False]
    warped = TopKLogitsWarper(2)(torch.zeros(1, 1, dtype=torch.long), logits)
    assert kept.tolist() == torch.isfinite(warped)[0].tolist()


def test_top_p_of_one_leaves_a_row_untouched_in_a_top_p_batch() -> None:
    """A row with top_p 1.0 beside one that filters keeps every token, bit for bit (float32
    rounding of the running mass dropped its smallest ones): its seeded draws do not depend on
    the batch."""
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(2, 5000) * 3, dim=-1)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)]
    out = filter_probs(probs, SamplingBatchInfo.from_params(params, [None, None], CPU))
    assert torch.equal(out[1], probs[1])


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_p=0.5),
    ]
    out = run(logits, params, [[1, 2], [3], [int(logits[2].argmax())], [4]])
    assert out[0] == logits[0].argmax()
    penalized = logits[2].clone()
    top = int(logits[2].argmax())
    penalized[top] = penalized[top] / 1.3 if penalized[top] > 0 else penalized[top] * 1.3
    assert out[2] == penalized.argmax()


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(3)
    vocab = 64
    logits = torch.randn(3, vocab) * 3
    penalties = [1.2, 0.8, 2.0]
    history = torch.randint(0, vocab, (3, 40))  # duplicates included
    ours = apply_repetition_penalty(
        logits, torch.tensor(penalties), history.tolist(), rows=[0, 1, 2]
    )
    for r, pen in enumerate(penalties):
        ref = RepetitionPenaltyLogitsProcessor(pen)(history[r : r + 1], logits[r : r + 1].clone())
        torch.testing.assert_close(ours[r : r + 1], ref, rtol=0, atol=0)
    # Greedy after penalty picks the argmax of the transformers-processed logits.
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    out = run(logits, params, history.tolist())
    for r, pen in enumerate(penalties):
        ref = RepetitionPenaltyLogitsProcessor(pen)(history[r : r + 1], logits[r : r + 1].clone())
        assert out[r] == ref.argmax()


@pytest.mark.parametrize("penalty", [1e-50, 1e-38])
def test_a_penalty_near_zero_samples_a_seen_token_not_nan(penalty: float) -> None:
    """A penalty below 1 favors the tokens already seen; near 0 (1e-50 is 0 in float32, 1e-38
    a subnormal) their positive logits divided by it are inf. The draw is then among them,
    never the NaN softmax's token 0, which is not in the history."""
    torch.manual_seed(0)
    logits = torch.randn(4, 32).abs() + 1.0  # every logit positive
    history = [[5, 9, 17]] * 4
    params = [SamplingParams(temperature=t, repetition_penalty=penalty, seed=s)
              for t, s in [(1.0, 1), (0.7, 2), (2.0, 3), (1.0, None)]]  # fmt: skip
    for _ in range(5):
        out = run(logits, params, history)
        assert set(out.tolist()) <= {5, 9, 17}, out


def test_repetition_penalty_ignores_out_of_vocab_ids_and_keeps_input() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    before = logits.clone()
    out = apply_repetition_penalty(logits, torch.tensor([2.0]), [[0, 1, 99]], rows=[0])
    assert torch.equal(out, torch.tensor([[0.5, -2.0, 2.0]]))
    assert torch.equal(logits, before)


def test_presence_and_frequency_penalties_follow_the_output_counts() -> None:
    """vLLM's rule, written out token by token: each output id's logit loses the presence
    penalty once and the frequency penalty per occurrence; prompt ids and other rows are
    untouched, and the repetition penalty (over prompt and output) comes first."""
    torch.manual_seed(4)
    vocab = 16
    logits = torch.randn(3, vocab) * 2
    prompt = [[1, 2, 3], [4, 4], [7]]
    output = [[3, 5, 5, 5, 99], [], [8, 8]]  # (99: past the vocab, ignored)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0, presence_penalty=-1.5),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.3),
    ]
    expected = logits.clone()
    for r, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            for t in set(prompt[r] + output[r]) & set(range(vocab)):
                x = expected[r, t]
                expected[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output[r]) & set(range(vocab)):
            count = output[r].count(t)
            expected[r, t] -= p.presence_penalty + p.frequency_penalty * count
    info = SamplingBatchInfo.from_params(params, [None] * 3, CPU)
    assert info.penalized_rows == [0, 1, 2] and info.count_rows == [0, 1, 2]
    assert info.repetition_rows == [2]
    history = [a + b for a, b in zip(prompt, output, strict=True)]
    out = Sampler()(logits, info, history, [len(a) for a in prompt])
    assert torch.equal(out.next_token_ids, expected.argmax(dim=-1))
    got = apply_count_penalties(
        logits, info.presence_penalties, info.frequency_penalties, output, [0, 1]
    )
    torch.testing.assert_close(got[:2], expected[:2], rtol=0, atol=1e-6)
    assert torch.equal(got[2], logits[2])  # a row not named is left alone


def hf_support(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tokens that transformers' warper chain (temperature, top-k, top-p, min-p) keeps."""
    scores = TemperatureLogitsWarper(p.temperature)(None, logits.clone())  # type: ignore[arg-type]
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)  # type: ignore[arg-type]
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)  # type: ignore[arg-type]
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)  # type: ignore[arg-type]
    return torch.isfinite(scores)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.9, min_p=0.05),
    ],
)
def test_filter_support_matches_transformers(p: SamplingParams) -> None:
    torch.manual_seed(4)
    logits = torch.randn(16, 200) * 2
    info = SamplingBatchInfo.from_params([p] * 16, [None] * 16, CPU)
    probs = torch.softmax(logits / p.temperature, dim=-1)
    kept = filter_probs(probs, info) > 0
    assert torch.equal(kept, hf_support(logits, p))


def test_top_p_keeps_smallest_prefix_reaching_top_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    for top_p, expected in [(0.4, [1]), (0.75, [1, 3]), (0.85, [1, 2, 3]), (1.0, [0, 1, 2, 3])]:
        info = SamplingBatchInfo.from_params([SamplingParams(top_p=top_p)], [None], CPU)
        kept = (filter_probs(probs, info)[0] > 0).nonzero().view(-1).tolist()
        assert kept == expected, top_p


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = torch.tensor([[0.4, 0.25, 0.19, 0.1, 0.06]])
    info = SamplingBatchInfo.from_params([SamplingParams(min_p=0.5)], [None], CPU)
    assert (filter_probs(probs, info)[0] > 0).tolist() == [True, True, False, False, False]


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    expected = expected_p * n
    return float(((counts - expected) ** 2 / expected).sum())


# Chi-square critical values at p = 0.001 (df = 2 and df = 7): a correct sampler exceeds them with
# probability 1/1000; the fixed seed makes each run deterministic anyway.
CHI2_CRIT = {2: 13.82, 7: 24.32}


@pytest.mark.parametrize(
    ("p", "df"),
    [
        (SamplingParams(temperature=0.5), 7),
        (SamplingParams(temperature=2.0), 7),
        (SamplingParams(temperature=0.8, top_k=3), 2),
    ],
)
def test_sampled_distribution(p: SamplingParams, df: int) -> None:
    torch.manual_seed(5)
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    n = 20000
    out = run(base.expand(n, -1), [p] * n)
    counts = torch.bincount(out, minlength=8).double()
    expected = torch.softmax(base.double() / p.temperature, dim=-1)
    if p.top_k > 0:
        expected[p.top_k :] = 0
        assert counts[p.top_k :].sum() == 0  # filtered tokens never drawn
        counts, expected = counts[: p.top_k], expected[: p.top_k] / expected.sum()
    assert chi_square(counts, expected) < CHI2_CRIT[df]


def test_seeded_request_independent_of_batch() -> None:
    torch.manual_seed(6)
    vocab, steps = 1000, 12
    step_logits = [torch.randn(vocab) for _ in range(steps)]
    target = SamplingParams(temperature=1.0, seed=1234)

    gen = make_generator(1234, CPU)
    alone: list[int] = []
    for lg in step_logits:
        info = SamplingBatchInfo.from_params([target], [gen], CPU)
        alone.append(int(Sampler()(lg.view(1, -1), info).next_token_ids[0]))

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=50),
        SamplingParams(temperature=1.1, seed=99, min_p=0.05),
    ]
    gens: list[torch.Generator | None] = [None, None, make_generator(99, CPU), None]
    gens[3] = make_generator(1234, CPU)
    batched: list[int] = []
    for lg in step_logits:
        torch.manual_seed(len(batched) + 100)  # perturb the shared generator
        logits = torch.stack([torch.randn(vocab), torch.randn(vocab), torch.randn(vocab), lg])
        info = SamplingBatchInfo.from_params([*others, target], gens, CPU)
        batched.append(int(Sampler()(logits, info).next_token_ids[3]))
    assert batched == alone

    other_seed = make_generator(4321, CPU)
    differs: list[int] = []
    for lg in step_logits:
        info = SamplingBatchInfo.from_params([target], [other_seed], CPU)
        differs.append(int(Sampler()(lg.view(1, -1), info).next_token_ids[0]))
    assert differs != alone


def test_logprobs_are_raw_log_softmax_of_chosen() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, 100)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.6, top_k=10, logprobs=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, seed=1, logprobs=True),
        SamplingParams(temperature=0.0),
    ]
    info = SamplingBatchInfo.from_params(params, [None, None, make_generator(1, CPU), None], CPU)
    before = logits.clone()
    out = Sampler()(logits, info, [[1], [2], [3, 4], [5]])
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    ref = torch.log_softmax(logits, dim=-1).gather(1, out.next_token_ids.view(-1, 1)).view(-1)
    torch.testing.assert_close(out.logprobs, ref)
    assert torch.equal(logits, before)  # input untouched


def test_ranks_and_top_logprobs_against_a_sort() -> None:
    """The chosen token's rank and the top tokens come from the raw distribution (sorted
    independently here), whatever the row's temperature or penalty, as many a row as the
    batch's largest `top_logprobs` (each request keeps its own count later)."""
    torch.manual_seed(11)
    logits = torch.randn(3, 64)
    params = [
        SamplingParams(temperature=0.0, top_logprobs=3),
        SamplingParams(temperature=2.0, seed=3, logprobs=True),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, top_logprobs=5),
    ]
    gens = [None, make_generator(3, CPU), None]
    out = Sampler()(logits, SamplingBatchInfo.from_params(params, gens, CPU), [[1], [2], [3]])
    assert out.ranks is not None and out.top_ids is not None and out.top_logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    order = torch.argsort(raw, dim=-1, descending=True)
    for row, chosen in enumerate(out.next_token_ids.tolist()):
        assert out.ranks[row] == order[row].tolist().index(chosen) + 1
    assert out.ranks[0] == 1  # greedy picks the most likely
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_ids, order[:, :5])
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, order[:, :5]))


def test_top_logprobs_beyond_a_small_vocabulary() -> None:
    info = SamplingBatchInfo.from_params([SamplingParams(top_logprobs=20)], [None], CPU)
    out = Sampler()(torch.randn(1, 6), info)
    assert out.top_ids is not None and sorted(out.top_ids[0].tolist()) == list(range(6))


def test_no_logprobs_unless_asked_and_bf16_input() -> None:
    logits = torch.randn(2, 50).to(torch.bfloat16)
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=0.0)] * 2, [None] * 2, CPU)
    out = Sampler()(logits, info)
    assert out.logprobs is None
    assert out.next_token_ids.dtype == torch.int64
    assert torch.equal(out.next_token_ids, logits.float().argmax(dim=-1))


def test_errors() -> None:
    with pytest.raises(ValueError, match="generators"):
        SamplingBatchInfo.from_params([SamplingParams()], [], CPU)
    info = SamplingBatchInfo.from_params([SamplingParams(repetition_penalty=1.1)], [None], CPU)
    with pytest.raises(ValueError, match="token_history"):
        Sampler()(torch.randn(1, 10), info)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(2, 10), info)


def test_batch_info_flags() -> None:
    params = [
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=0.9, top_k=0),
        SamplingParams(temperature=0.9, min_p=0.1, logprobs=True),
    ]
    info = SamplingBatchInfo.from_params(params, [None] * 3, CPU)
    assert info.greedy_rows == [0] and info.sampled_rows == [1, 2]
    assert not info.all_greedy and not info.need_top_p and not info.need_top_k and info.need_min_p
    assert info.return_logprobs and info.penalized_rows == []
    assert info.temperatures.view(-1).tolist() == pytest.approx([1.0, 0.9, 0.9])
    assert math.isclose(float(info.min_ps[2]), 0.1, rel_tol=1e-6)


@pytest.mark.cuda
def test_cuda_seeded_matches_itself_and_greedy_matches_cpu() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(8)
    logits = torch.randn(3, 32000)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(temperature=0.8, top_k=40, min_p=0.02),
    ]
    hist = [[1, 2, 3], [4], [5]]
    cpu_out = run(logits, params, hist)
    a = run(logits, params, hist, dev)
    b = run(logits, params, hist, dev)
    assert a.device.type == "cuda"
    assert a[0] == cpu_out[0]
    assert a[1] == b[1]


def test_suppressed_token_ids_never_chosen() -> None:
    torch.manual_seed(9)
    logits = torch.randn(3, 20)
    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(temperature=0.0),
    ]
    gens: list[torch.Generator | None] = [None, make_generator(2, CPU), None]
    suppressed = [[top[0]], list(range(19)), []]
    info = SamplingBatchInfo.from_params(params, gens, CPU, suppressed_token_ids=suppressed)
    before = logits.clone()
    out = Sampler()(logits, info).next_token_ids.tolist()
    masked = logits[0].clone()
    masked[top[0]] = float("-inf")
    assert out == [int(masked.argmax()), 19, top[2]]
    assert torch.equal(logits, before)
