"""Per-request sampling parameters, validated at construction.

`SamplingParams` is the one place where user-supplied sampling settings are checked. Everything
downstream (scheduler, sampler, detokenizer) trusts a constructed instance. Requests arriving over
the wire (Triton's `sampling_parameters` input, a JSON object) go through `from_json` /
`from_dict`, which also accept numbers and booleans sent as strings, since clients such as
genai-perf send `{"max_tokens": "16"}`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, NoReturn


class SamplingParamsError(ValueError):
    """A sampling parameter is missing, of the wrong type, or out of range.

    The message names the field and the offending value.
    """


_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "top_logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "logprobs", "skip_special_tokens")


GREEDY_TEMPERATURE = 1e-5  # below this a temperature samples as greedy (as in vLLM)
# The sampler divides and multiplies logits in float32: a larger temperature or penalty is inf
# there, and inf / inf or 0 * inf a NaN that argmax picks.
FLOAT32_MAX = 3.4028234663852886e38
# A request's stop conditions are checked on the engine's thread for every token of every
# request in the batch: bounded so that one request cannot slow the others' steps (10,000
# stop strings cost 8.6 ms a token on a CPU).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# The most top tokens a request may ask log-probabilities of, each step (vLLM's default
# `max_logprobs`, OpenAI's `top_logprobs` bound).
MAX_TOP_LOGPROBS = 20
# The most sequences one request may ask for (`n`): each is a request of its own in the batch.
MAX_N = 64
# vLLM's (and OpenAI's) range for presence_penalty and frequency_penalty.
MAX_COUNT_PENALTY = 2.0


@dataclass
class SamplingParams:
    """How to sample the continuation of one request.

    Contract:
      - `validate()` runs in `__post_init__`; an instance that exists is valid. Mutating a field
        afterwards is the caller's responsibility (call `validate()` again).
      - `top_k` of 0 or -1 means "off" and is normalized to -1.
      - `stop` is always a list of non-empty strings (None or a single string are accepted and
        normalized); `stop_token_ids` is always a list of non-negative ints.
      - `min_tokens` suppresses EOS / stop tokens until that many tokens were generated, and
        stop strings are looked for only in the text after them;
        `ignore_eos` keeps generating past EOS until `max_tokens`.
      - `logprobs=True` asks for the log-probability of each chosen token and its rank (1 for
        the most likely token; see `Sampler`); `top_logprobs=N` (at most 20) adds the N most
        likely tokens' and turns `logprobs` on. On the wire vLLM's form, `"logprobs": N`, means
        `logprobs=True, top_logprobs=N` (0: the chosen token's alone).
      - `presence_penalty` and `frequency_penalty` (in [-2, 2], vLLM's and OpenAI's) subtract,
        from the logit of every token the request has generated so far, the penalty once and
        the penalty times the token's count; `repetition_penalty` (Hugging Face's rule, over
        the prompt and the output) applies before them.
      - `seed` makes this request's draws reproducible regardless of the batch it runs in.
      - `n` (at most 64) samples that many sequences for the prompt, each its own request in
        the engine (sequence i seeded with `seed + i` when a seed is given).
      - Greedy decoding (`is_greedy`) is temperature 0 (or below 1e-5, as in vLLM) or top_k 1.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalize the accepted shorthands before validating.
        stop: Any = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, (list, tuple)):
            self.stop = list(stop)
        ids: Any = self.stop_token_ids
        if ids is None:
            self.stop_token_ids = []
        elif isinstance(ids, (list, tuple)):
            self.stop_token_ids = list(ids)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1
        if _is_int(self.top_logprobs) and self.top_logprobs > 0:
            self.logprobs = True
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if _is_int(value):
                setattr(self, name, _int_to_float(name, value))
        self.validate()

    @property
    def penalizes(self) -> bool:
        """Whether sampling reads the request's tokens so far (a repetition, presence or
        frequency penalty)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits: temperature 0, or
        below 1e-5 as vLLM takes it (logits / T would overflow float32), or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field and its value."""
        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                _fail(name, getattr(self, name), "must be an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, float) or math.isnan(value):
                _fail(name, value, "must be a number")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be true or false")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "must be an integer or null")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # (what a torch.Generator takes: a larger seed would fail inside the engine step)
            _fail("seed", self.seed, "must be in [-2**63, 2**64)")

        if not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"must be in [1, {MAX_N}]")
        if self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be >= 0")
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= FLOAT32_MAX:
            _fail("temperature", self.temperature, "must be in [0, 3.4e38] (a finite float32)")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            _fail("top_k", self.top_k, "must be -1 or 0 (off) or >= 1")
        if self.top_k >= 2**63:
            # (the sampler holds top_k in int64: a larger one would fail its batch's step)
            _fail("top_k", self.top_k, "must be below 2**63")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            _fail("top_logprobs", self.top_logprobs, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_COUNT_PENALTY <= value <= MAX_COUNT_PENALTY:
                _fail(name, value, f"must be in [-{MAX_COUNT_PENALTY:g}, {MAX_COUNT_PENALTY:g}]")
        if not 0.0 < self.repetition_penalty <= FLOAT32_MAX:
            why = "must be in (0, 3.4e38] (a finite float32)"
            _fail("repetition_penalty", self.repetition_penalty, why)

        if not isinstance(self.stop, list):
            _fail("stop", self.stop, "must be a string, a list of strings, or null")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", s, "entries must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                why = f"entries must be at most {MAX_STOP_STRING_CHARS} characters"
                _fail("stop", f"<a string of {len(s)} characters>", why)
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids or null")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            n = len(self.stop_token_ids)
            _fail("stop_token_ids", f"<{n} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", t, "entries must be integers >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a wire-format dict (e.g. the parsed `sampling_parameters` JSON).

        Unknown keys are rejected by name. Numeric fields accept numeric strings ("16", "0.7"),
        boolean fields accept true/false and the strings "true"/"false". `logprobs`
        may be vLLM's count of top tokens (an integer), which sets `top_logprobs` too.
        """
        if not isinstance(d, dict):
            raise SamplingParamsError(
                f"sampling parameters must be a JSON object, got {type(d).__name__}"
            )
        logprob_keys = ("logprobs", "top_logprobs")
        d = {k: v for k, v in d.items() if k not in logprob_keys} | _logprob_fields(d)
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise SamplingParamsError(
                    f"unknown sampling parameter {key!r}; known: {', '.join(sorted(known))}"
                )
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, s: str | bytes) -> SamplingParams:
        """Parse a JSON object of sampling parameters; an empty string means all defaults."""
        if isinstance(s, bytes):
            s = s.decode("utf-8")
        if not s.strip():
            return cls()
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise SamplingParamsError(f"sampling parameters are not valid JSON: {e}") from e
        except RecursionError:
            raise SamplingParamsError("sampling parameters are nested too deeply") from None
        if not isinstance(d, dict):
            raise SamplingParamsError(
                f"sampling parameters must be a JSON object, got {type(d).__name__}"
            )
        return cls.from_dict(d)

    def for_sequence(self, index: int) -> SamplingParams:
        """The settings of sequence `index` of an `n`-sequence request: one sequence, seeded
        with `seed + index` (wrapping within the seeds a generator takes) when seeded."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed >= 2**64:
                seed -= 2**64
        return dataclasses.replace(self, n=1, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (round-trips through `from_dict`)."""
        return dataclasses.asdict(self)


def _fail(name: str, value: Any, why: str) -> NoReturn:
    raise SamplingParamsError(f"{name}={value!r}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprob_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The wire's logprob settings as the two fields: vLLM's `"logprobs": N` (a count of top
    tokens: logprobs on, top_logprobs N) or a flag, and `top_logprobs`; null is absent."""
    fields: dict[str, Any] = {}
    top = d.get("top_logprobs")
    if top is not None:
        fields["top_logprobs"] = _coerce_int("top_logprobs", top)
    value = d.get("logprobs")
    if value is None:
        return fields
    count = _as_count(value)
    if count is not None:
        if not 0 <= count <= MAX_TOP_LOGPROBS:
            why = f"must be true, false or a count of top tokens in [0, {MAX_TOP_LOGPROBS}]"
            _fail("logprobs", value, why)
        if fields.get("top_logprobs", count) != count:
            _fail("top_logprobs", top, f"disagrees with logprobs={value!r}")
        return {"logprobs": True, "top_logprobs": count}
    fields["logprobs"] = _coerce_bool("logprobs", value)
    if not fields["logprobs"] and fields.get("top_logprobs"):
        _fail("top_logprobs", top, f"asks for top tokens with logprobs={value!r}")
    return fields


def _as_count(value: Any) -> int | None:
    """`value` as an integer when it is one, as JSON or as a string ("5", "5.0"); None for a
    boolean, "true"/"false" or anything else (then read as a flag)."""
    try:
        return _coerce_int("logprobs", value)
    except SamplingParamsError:
        return None


def _coerce(name: str, value: Any) -> Any:
    """Turn wire-format values (numeric / boolean strings) into the field's Python type."""
    if name in _INT_FIELDS or (name == "seed" and value is not None):
        return _coerce_int(name, value)
    if name in _FLOAT_FIELDS:
        return _coerce_float(name, value)
    if name in _BOOL_FIELDS:
        return _coerce_bool(name, value)
    if name == "stop_token_ids" and isinstance(value, (list, tuple)):
        return [_coerce_int(name, v) for v in value]
    return value


def _coerce_int(name: str, value: Any) -> int:
    if _is_int(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = math.nan
            if f.is_integer():
                return int(f)
    _fail(name, value, "must be an integer")


def _int_to_float(name: str, value: int) -> float:
    try:
        return float(value)
    except OverflowError:  # (an int past 1.8e308: not a ValueError, and it names no field)
        _fail(name, value, "must be a number within float range")


def _coerce_float(name: str, value: Any) -> float:
    if _is_int(value):
        return _int_to_float(name, value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    _fail(name, value, "must be a number")


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    _fail(name, value, "must be true or false")
