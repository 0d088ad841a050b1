"""Batched token sampling from next-token logits.

Pipeline per batch (logits [B, V], one row per request):
  1. repetition penalty (Hugging Face rule), then presence and frequency penalties (vLLM's, over
     the output so far) on every row that asks for them;
  2. greedy rows: exactly `argmax` of the penalized logits (so greedy output matches
     transformers' `generate(do_sample=False)` on the same logits);
  3. other rows: / temperature -> softmax -> top-k -> top-p -> min-p -> draw one token.

Per-request seeds: a request with a seed owns a `torch.Generator` (made once by the caller with
`make_generator`) and its row is drawn with that generator alone, so its tokens do not depend on
which other requests share the batch. Unseeded rows share torch's default generator.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.kernels.argmax import argmax_rows
from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

# The largest logit a repetition penalty leaves (far above any model's): finite in float32 once
# divided by the smallest temperature that samples.
PENALIZED_MAX = 1e30
assert PENALIZED_MAX / GREEDY_TEMPERATURE < torch.finfo(torch.float32).max


def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of `values` on `device`. To a GPU through pinned memory without blocking:
    `torch.tensor(values, device=gpu)` waits for all queued work, which would stall the
    overlap schedule (the host preparing step n+1 while the GPU runs step n)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [B, V], the same index (the first of equal maxima, NaN the
    largest), on CUDA by `engine.kernels.argmax` (two launches, 3 us at one row of 102,400 on
    an H200, a batch-1 decode step's logits): torch reduces each row with one thread block
    (22.7 us there), and a two-stage torch form took five kernels (about 16 us)."""
    if x.is_cuda:
        return argmax_rows(x)
    return torch.argmax(x, dim=-1)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device its draws will happen on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def argmax_suffices(params: SamplingParams, suppressed_token_ids: list[int]) -> bool:
    """True when `Sampler` picks exactly `argmax` of this row's logits: greedy, no penalty, no
    logprobs asked, nothing suppressed. A batch of such rows needs no
    `SamplingBatchInfo` at all."""
    return (
        params.is_greedy
        and not params.penalizes
        and not params.logprobs
        and not suppressed_token_ids
    )


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32; None unless some request asked for logprobs
    ranks: torch.Tensor | None = None  # [B] int64, the chosen token's rank (1: most likely)
    top_ids: torch.Tensor | None = None  # [B, K] int64, K the batch's largest top_logprobs
    top_logprobs: torch.Tensor | None = None  # [B, K] float32, most likely first


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling tensors, built once per batch with `from_params`.

    Row i describes request i of the batch, in the same order as the logits rows. The boolean
    `need_*` flags are computed on the host so the sampler can skip whole stages without a
    device sync.
    """

    temperatures: torch.Tensor  # [B, 1] float32; greedy rows hold 1.0 (never used)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; -1 = off
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]  # one per row; None = default generator
    greedy_rows: list[int]
    sampled_rows: list[int]
    penalized_rows: list[int]  # rows with a penalty (they need the token history)
    repetition_rows: list[int]  # rows with repetition_penalty != 1
    count_rows: list[int]  # rows with a presence or frequency penalty
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    return_logprobs: bool
    max_top_logprobs: int  # the largest `top_logprobs` of the batch's requests
    device: torch.device

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        suppressed_token_ids: list[list[int]] | None = None,
    ) -> SamplingBatchInfo:
        """`suppressed_token_ids[i]`: ids row i must not produce this step (e.g. EOS and
        stop_token_ids while a request is below min_tokens); the caller decides which."""
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} params but {len(generators)} generators")
        dev = torch.device(device)
        suppressed = None
        if suppressed_token_ids is not None:
            if len(suppressed_token_ids) != len(params):
                raise ValueError(
                    f"{len(params)} params but {len(suppressed_token_ids)} suppressed_token_ids"
                )
            pairs = [(r, t) for r, ids in enumerate(suppressed_token_ids) for t in ids]
            if pairs:
                both = host_to_device(pairs, torch.int64, dev)
                suppressed = (both[:, 0], both[:, 1])
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]

        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        # One copy for the float fields, one for the integer ones.
        floats = [temps, [p.top_p for p in params], [p.min_p for p in params]]
        floats.append([p.repetition_penalty for p in params])
        floats.append([p.presence_penalty for p in params])
        floats.append([p.frequency_penalty for p in params])
        temperatures, top_ps, min_ps, penalties, presence, frequency = host_to_device(
            floats, torch.float32, dev
        )
        top_ks, is_greedy = host_to_device(
            [[p.top_k for p in params], [int(g) for g in greedy]], torch.int64, dev
        )
        return cls(
            temperatures=temperatures.view(-1, 1),
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            repetition_penalties=penalties,
            presence_penalties=presence,
            frequency_penalties=frequency,
            is_greedy=is_greedy.bool(),
            generators=list(generators),
            greedy_rows=[i for i, g in enumerate(greedy) if g],
            sampled_rows=[i for i, g in enumerate(greedy) if not g],
            penalized_rows=[i for i, p in enumerate(params) if p.penalizes],
            repetition_rows=[i for i, p in enumerate(params) if p.repetition_penalty != 1.0],
            count_rows=[
                i
                for i, p in enumerate(params)
                if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            ],
            suppressed=suppressed,
            all_greedy=all(greedy),
            need_top_k=any(p.top_k != -1 for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            return_logprobs=any(p.logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            device=dev,
        )


def apply_repetition_penalty(
    logits: torch.Tensor,
    penalties: torch.Tensor,
    token_history: list[list[int]],
    rows: list[int],
) -> torch.Tensor:
    """Hugging Face's repetition penalty, out of place, on the given rows.

    For every token id seen in a row's history (prompt + output so far): a logit > 0 is divided
    by the penalty, otherwise it is multiplied by it (as `RepetitionPenaltyLogitsProcessor`).
    logits [B, V] float32, penalties [B].
    """
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for r in rows:
        # Ids outside the logits' vocab (added tokens past lm_head) cannot be sampled; skip them.
        toks = {t for t in set(token_history[r]) if 0 <= t < vocab}
        row_idx.extend([r] * len(toks))
        tok_idx.extend(toks)
    if not row_idx:
        return logits
    r_t, t_t = host_to_device([row_idx, tok_idx], torch.int64, logits.device)
    picked = logits[r_t, t_t]
    pen = penalties[r_t]
    out = logits.clone()
    # NOTE: a penalty near 0 turns a seen token's positive logit to inf (x / penalty), and a
    # softmax over two infs is NaN. Held at PENALIZED_MAX, such tokens share the draw, and
    # stay finite divided by any sampling temperature (>= GREEDY_TEMPERATURE).
    out[r_t, t_t] = torch.where(picked > 0, picked / pen, picked * pen).clamp_(max=PENALIZED_MAX)
    return out


def apply_count_penalties(
    logits: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    outputs: list[list[int]],
    rows: list[int],
) -> torch.Tensor:
    """vLLM's presence and frequency penalties, out of place, on the given rows: from the logit
    of every token id that a row's `outputs` (its generated ids so far) hold c > 0 times,
    subtract presence + frequency * c. logits [B, V] float32, presence and frequency [B]."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    counts: list[int] = []
    for r in rows:
        for tok, count in Counter(t for t in outputs[r] if 0 <= t < vocab).items():
            row_idx.append(r)
            tok_idx.append(tok)
            counts.append(count)
    if not row_idx:
        return logits
    r_t, t_t, c_t = host_to_device([row_idx, tok_idx, counts], torch.int64, logits.device)
    out = logits.clone()
    out[r_t, t_t] -= presence[r_t] + frequency[r_t] * c_t.float()
    return out


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero out tokens removed by top-k, then top-p, then min-p; same vocab order as `probs`.

    probs [N, V] (rows = `info.sampled_rows`). Rows are not renormalized: the draw
    (argmax of p / noise) is scale-free, and leaving untouched rows bit-identical keeps a seeded
    request's draws independent of whether its batch needed filtering at all.
    """
    rows = host_to_device(info.sampled_rows, torch.int64, probs.device)
    vocab = probs.shape[-1]
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    if info.need_top_k:
        # NOTE: tokens tied with the k-th stay (as HF and vLLM mask below the k-th value):
        # bf16 logits tie often, and cutting at rank k would favour the lower token ids.
        top_ks = info.top_ks[rows]
        top_ks = torch.where((top_ks < 1) | (top_ks > vocab), vocab, top_ks).view(-1, 1)
        kth = probs_sort.gather(1, top_ks - 1)
        probs_sort = probs_sort.masked_fill(probs_sort < kth, 0.0)
    if info.need_top_p:
        # Smallest prefix whose mass reaches top_p of what top-k kept (as HF / vLLM: top-p
        # acts on the renormalized top-k distribution). A token is kept when the mass strictly
        # before it is < top_p; the top token always survives since that mass is 0.
        cum = torch.cumsum(probs_sort, dim=-1)
        kept_mass = cum[:, -1:]
        before = cum - probs_sort
        top_ps = info.top_ps[rows].view(-1, 1)
        drop = (before >= top_ps * kept_mass) & (top_ps < 1.0)  # (1.0: rounding drops no tail)
        drop[:, 0] = False
        probs_sort = probs_sort.masked_fill(drop, 0.0)
    if info.need_min_p:
        threshold = probs_sort[:, :1] * info.min_ps[rows].view(-1, 1)
        probs_sort = probs_sort.masked_fill(probs_sort < threshold, 0.0)
    return torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)


class Sampler(torch.nn.Module):
    """Turns next-token logits into one token id per request.

    `forward(logits [B, V], info, token_history)` -> `SampleOutput`:
      - `token_history[i]` is request i's prompt + output ids so far, the first
        `prompt_lens[i]` of them its prompt; they are read only when some row has a penalty
        (pass None otherwise);
      - ids in `info.suppressed` (see `from_params`) get -inf after the penalty, so they are
        never chosen (unless a row suppresses its whole vocab);
      - greedy rows return exactly `argmax` of the penalized logits (first index on ties);
      - sampled rows draw from softmax(penalized logits / temperature) restricted by top-k,
        top-p and min-p, in that order; seeded rows draw with their own generator only;
      - `logprobs[i]` (when any request asked) is the log-probability of the chosen token under
        the raw model distribution, log_softmax of the unprocessed logits. This is vLLM's default
        ("raw logprobs"): it does not change with temperature or penalties, so a client can
        compare it across sampling settings. `ranks[i]` is its rank there (1 + the number of
        tokens more likely), and `top_ids` / `top_logprobs` the batch's largest
        `top_logprobs` count of most likely tokens a row, most likely first.
        Rows that did not ask get values too; callers ignore them.
    The input logits are not modified.
    """

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        token_history: list[list[int]] | None = None,
        prompt_lens: list[int] | None = None,
    ) -> SampleOutput:
        raw = logits.float()
        batch, vocab = raw.shape
        if batch != info.batch_size:
            raise ValueError(f"logits have {batch} rows, sampling info {info.batch_size}")

        penalized = raw
        if info.penalized_rows:
            if token_history is None:
                raise ValueError("a penalty needs token_history")
            if info.repetition_rows:
                penalized = apply_repetition_penalty(
                    penalized, info.repetition_penalties, token_history, info.repetition_rows
                )
            if info.count_rows:
                starts = prompt_lens or [0] * batch
                outputs = [h[start:] for h, start in zip(token_history, starts, strict=True)]
                penalized = apply_count_penalties(
                    penalized, info.presence_penalties, info.frequency_penalties, outputs,
                    info.count_rows,
                )  # fmt: skip
        if info.suppressed is not None:
            if penalized is raw:
                penalized = raw.clone()
            # NOTE: a Python float as the value would be copied to the device synchronously.
            penalized.index_put_(info.suppressed, penalized.new_full((1,), float("-inf")))

        if info.all_greedy:
            next_ids = first_argmax(penalized)
        else:
            next_ids = self._sample(penalized, info)

        if not info.return_logprobs:
            return SampleOutput(next_ids, None)
        all_logprobs = torch.log_softmax(raw, dim=-1)
        logprobs = all_logprobs.gather(1, next_ids.view(-1, 1))
        ranks = (all_logprobs > logprobs).sum(dim=-1) + 1
        top_ids = top_logprobs = None
        if info.max_top_logprobs:
            count = min(info.max_top_logprobs, vocab)
            top_logprobs, top_ids = torch.topk(all_logprobs, count, dim=-1)
        return SampleOutput(next_ids, logprobs.view(-1), ranks, top_ids, top_logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        next_ids = first_argmax(logits)  # greedy rows keep this
        rows = host_to_device(info.sampled_rows, torch.int64, logits.device)
        probs = torch.softmax(logits[rows] / info.temperatures[rows], dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            probs = filter_probs(probs, info)

        # Exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. draws token i with probability
        # p_i (the Gumbel-max trick in another form). Each seeded row fills its own noise from
        # its own generator, so its draw depends on nothing else in the batch; unseeded rows
        # share one fill from the default generator.
        noise = torch.empty_like(probs)
        shared: list[int] = []  # positions in `rows` that use the default generator
        for pos, row in enumerate(info.sampled_rows):
            gen = info.generators[row]
            if gen is None:
                shared.append(pos)
            else:
                noise[pos].exponential_(generator=gen)
        if len(shared) == len(info.sampled_rows):
            noise.exponential_()
        elif shared:
            pos_t = host_to_device(shared, torch.int64, logits.device)
            noise[pos_t] = torch.empty_like(noise[pos_t]).exponential_()
        # NOTE: Exp(1) can round to 0; clamp so a filtered token (p = 0) never gets 0/0 = NaN.
        drawn = torch.argmax(probs / noise.clamp_min_(1e-10), dim=-1)
        next_ids[rows] = drawn
        return next_ids
