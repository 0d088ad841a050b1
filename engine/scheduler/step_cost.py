"""How long a prefill step of n tokens takes: fixed + per_token * n, fit to the recent steps.

The scheduler caps a prefill step beside decoding requests at what runs in about one decode
step's time (scheduler.PREFILL_STALL_S at least). A cost per token alone (seconds / tokens of the
last steps) breaks where a step has a large fixed cost: the eager forward on a GPU is bound by
the host at small sizes (on the H200 a 1-token prefill of DeepSeek-V2-Lite took about 25 ms and a
2,048-token one about 33 ms), so after prompts served from the prefix cache (1 new token each)
the old estimate read 25 ms per token and cut the next prompts into 32-token chunks of 25 ms
each: a 512-token prompt then took 16 steps, with every running request waiting behind them.

Here the two terms come from a least-squares line through the recent (tokens, seconds) pairs,
older ones weighed down by DECAY per step. Until the steps seen have two sizes far enough apart
to split the terms, `budget` scales the newest step's size by limit / its time: with a fixed cost
of zero or more, a size scaled up this way never runs past the limit. No tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight kept by the older steps at each new one
MIN_SPREAD = 0.25  # sizes must spread by this share of their mean before the line is trusted


@dataclass
class PrefillCost:
    s0: float = 0.0  # decayed sums: weights, n, n^2, t, n * t
    s1: float = 0.0
    s2: float = 0.0
    t0: float = 0.0
    t1: float = 0.0
    last: tuple[int, float] | None = None  # the newest (tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self.s0 = d * self.s0 + 1.0
        self.s1 = d * self.s1 + tokens
        self.s2 = d * self.s2 + tokens * tokens
        self.t0 = d * self.t0 + seconds
        self.t1 = d * self.t1 + tokens * seconds
        self.last = (tokens, seconds)

    @property
    def seen(self) -> bool:
        return self.last is not None

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the sizes are too alike to tell.
        Noise can tilt the line below flat (host-bound steps): the cost per token is then 0."""
        if self.s0 == 0.0:
            return None
        mean = self.s1 / self.s0
        var = self.s2 / self.s0 - mean * mean
        if var <= (MIN_SPREAD * mean) ** 2:  # tokens > 0, so this also covers var <= 0
            return None
        per_token = (self.t1 / self.s0 - mean * self.t0 / self.s0) / var
        per_token = max(per_token, 0.0)
        fixed = max(self.t0 / self.s0 - per_token * mean, 0.0)
        return fixed, per_token

    def budget(self, limit_s: float, cap: int, floor: int) -> int:
        """Tokens of a prefill step that should take at most `limit_s`, within [floor, cap]."""
        line = self.fit()
        if line is not None:
            fixed, per_token = line
            if per_token == 0.0:
                n = cap if fixed <= limit_s else floor
            else:
                n = int((limit_s - fixed) / per_token + 1e-6)  # no 49.999 for 50
        elif self.last is not None:  # one size so far: as if every second were per token
            tokens, seconds = self.last
            n = int(tokens * limit_s / seconds) if seconds > 0 else cap
        else:
            n = cap
        return max(floor, min(cap, n))
