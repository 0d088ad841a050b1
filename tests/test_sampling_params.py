"""SamplingParams: validation messages, normalization, wire-format parsing."""

from __future__ import annotations

from typing import Any

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1 and p.min_p == 0.0
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.logprobs and p.skip_special_tokens
    assert p.repetition_penalty == 1.0
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -3}, "max_tokens", "-3"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "20"),
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"stop": ["ok", ""]}, "stop", "''"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "-1"),
        # bounded: stop conditions are checked for every token of every request in the batch
        ({"stop": ["s"] * 65}, "stop", "65 strings"),
        ({"stop": ["x" * 1025]}, "stop", "1025 characters"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "1025 ids"),
        ({"max_tokens": "16"}, "max_tokens", "'16'"),
        ({"max_tokens": True}, "max_tokens", "True"),
        ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"seed": 2**64}, "seed", str(2**64)),  # beyond what a torch.Generator takes
        ({"seed": -(2**63) - 1}, "seed", str(-(2**63) - 1)),
    ],
)
def test_validation_names_field_and_value(kwargs: dict[str, Any], field: str, value: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"{field}="), msg
    assert value in msg, msg
    assert isinstance(e.value, ValueError)


def test_logprobs_takes_vllms_count_of_top_tokens() -> None:
    one = SamplingParams.from_dict({"logprobs": 1})
    assert one.logprobs and one.top_logprobs == 1
    zero = SamplingParams.from_dict({"logprobs": 0})  # the chosen token's alone
    assert zero.logprobs and zero.top_logprobs == 0
    assert SamplingParams.from_dict({"logprobs": "5"}).top_logprobs == 5
    both = SamplingParams.from_dict({"logprobs": 3, "top_logprobs": 3})
    assert both.logprobs and both.top_logprobs == 3
    flag = SamplingParams.from_dict({"logprobs": "true"})
    assert flag.logprobs and flag.top_logprobs == 0
    assert SamplingParams(top_logprobs=2).logprobs  # top tokens turn the chosen one's on
    assert SamplingParams.from_dict({"logprobs": "5.0"}).top_logprobs == 5
    nulls = SamplingParams.from_dict({"logprobs": None, "top_logprobs": None})  # OpenAI's
    assert not nulls.logprobs and nulls.top_logprobs == 0
    assert SamplingParams.from_dict({"logprobs": 3, "top_logprobs": None}).top_logprobs == 3
    openai = SamplingParams.from_dict({"logprobs": True, "top_logprobs": 4})
    assert openai.logprobs and openai.top_logprobs == 4


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"logprobs": 21}, r"logprobs=21: .* count of top tokens in \[0, 20\]"),
        ({"top_logprobs": -1}, r"top_logprobs=-1: must be in \[0, 20\]"),
        ({"logprobs": -2}, "logprobs=-2: must be true, false or a count of top tokens"),
        ({"logprobs": 2, "top_logprobs": 4}, "top_logprobs=4: disagrees with logprobs=2"),
        ({"top_logprobs": "many"}, "top_logprobs='many': must be an integer"),
        ({"logprobs": "yes"}, "logprobs='yes': must be true or false"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs=3: asks for top tokens with"),
    ],
)
def test_bad_logprob_counts_are_named(d: dict[str, object], match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams.from_dict(d)


def test_normalization() -> None:
    p = SamplingParams(top_k=0, stop="###", stop_token_ids=None, temperature=1)  # type: ignore[arg-type]
    assert p.top_k == -1
    assert p.stop == ["###"]
    assert p.stop_token_ids == []
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_min_tokens_equal_max_tokens_ok() -> None:
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_from_dict_coerces_strings() -> None:
    p = SamplingParams.from_dict(
        {
            "max_tokens": "16",
            "min_tokens": "2",
            "temperature": "0.7",
            "top_p": "0.9",
            "top_k": "40",
            "min_p": "0.05",
            "seed": "1234",
            "ignore_eos": "true",
            "logprobs": "False",
            "skip_special_tokens": False,
            "repetition_penalty": 1,
            "stop": "\n\n",
            "stop_token_ids": ["2", 7],
        }
    )
    assert p.max_tokens == 16 and p.min_tokens == 2
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    assert p.top_k == 40 and p.min_p == pytest.approx(0.05) and p.seed == 1234
    assert p.ignore_eos is True and p.logprobs is False and p.skip_special_tokens is False
    assert p.repetition_penalty == 1.0
    assert p.stop == ["\n\n"] and p.stop_token_ids == [2, 7]


def test_from_dict_integral_float_accepted() -> None:
    assert SamplingParams.from_dict({"max_tokens": 8.0}).max_tokens == 8
    assert SamplingParams.from_dict({"max_tokens": "8.0"}).max_tokens == 8


@pytest.mark.parametrize(
    ("d", "needle"),
    [
        ({"max_tokens": "sixteen"}, "max_tokens='sixteen'"),
        ({"max_tokens": 2.5}, "max_tokens=2.5"),
        ({"temperature": "hot"}, "temperature='hot'"),
        ({"ignore_eos": 1}, "ignore_eos=1"),
        ({"top_p": "0"}, "top_p=0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
        ({"frequency_penalty": "-3"}, "frequency_penalty=-3.0"),
        ({"n": 0}, "n=0"),
        ({"n": 65}, "n=65"),
        ({"n": 1.5}, "n=1.5"),
    ],
)
def test_from_dict_bad_values(d: dict[str, Any], needle: str) -> None:
    with pytest.raises(SamplingParamsError, match=needle.replace(".", r"\.")):
        SamplingParams.from_dict(d)


def test_from_dict_unknown_key_named() -> None:
    with pytest.raises(SamplingParamsError, match="'max_new_tokens'"):
        SamplingParams.from_dict({"max_new_tokens": 3})
    with pytest.raises(SamplingParamsError, match="'best_of'"):
        SamplingParams.from_dict({"best_of": 1})


def test_from_dict_n_accepted() -> None:
    assert SamplingParams.from_dict({"n": "1", "max_tokens": 4}).max_tokens == 4
    assert SamplingParams.from_dict({"n": "3"}).n == 3


def test_for_sequence_is_one_sequence_seeded_apart() -> None:
    p = SamplingParams(n=3, seed=7, temperature=0.8)
    kids = [p.for_sequence(i) for i in range(3)]
    assert [(k.n, k.seed, k.temperature) for k in kids] == [(1, 7, 0.8), (1, 8, 0.8), (1, 9, 0.8)]
    assert SamplingParams(n=2).for_sequence(1).seed is None
    top = SamplingParams(n=2, seed=2**64 - 1).for_sequence(1)
    assert top.seed == 0  # wraps within what a generator takes


def test_from_json() -> None:
    p = SamplingParams.from_json('{"max_tokens": "16", "temperature": 0, "stop": ["</s>"]}')
    assert p.max_tokens == 16 and p.is_greedy and p.stop == ["</s>"]
    assert SamplingParams.from_json("") == SamplingParams()
    assert SamplingParams.from_json(b'{"top_k": 5}').top_k == 5


@pytest.mark.parametrize(
    ("s", "needle"),
    [
        ('{"max_tokens": 16', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"hello"', "must be a JSON object, got str"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_from_json_errors(s: str, needle: str) -> None:
    with pytest.raises(SamplingParamsError, match=needle):
        SamplingParams.from_json(s)


def test_stop_conditions_at_their_bounds_are_accepted() -> None:
    params = SamplingParams(stop=["x" * 1024] * 64, stop_token_ids=list(range(1024)))
    assert len(params.stop) == 64 and len(params.stop_token_ids) == 1024


def test_round_trip() -> None:
    p = SamplingParams(max_tokens=5, temperature=0.3, stop=["x"], seed=7, logprobs=True)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_top_k_fits_the_samplers_int64() -> None:
    """A top_k past int64 was accepted, then failed the sampling step of its whole batch (the
    sampler copies top_k into an int64 tensor), ending every request in it with an error."""
    from engine.layers.sampler import SamplingBatchInfo

    with pytest.raises(SamplingParamsError, match=f"top_k={2**63}"):
        SamplingParams.from_dict({"top_k": 2**63, "temperature": 0.5})
    big = SamplingParams(top_k=2**63 - 1, temperature=0.5)  # larger than any vocab: no filter
    SamplingBatchInfo.from_params([big, SamplingParams()], [None, None], "cpu")


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_values_beyond_float32_are_refused(name: str) -> None:
    """The sampler computes in float32, where 1e39 is inf: logits / inf and 0 * inf gave NaN
    rows, whose argmax drew token 0 (or a penalized token) every step instead of an error."""
    with pytest.raises(SamplingParamsError, match=f"{name}=1e\\+39"):
        SamplingParams(**{name: 1e39})
    assert getattr(SamplingParams(**{name: 3.4e38}), name) == 3.4e38


def test_integer_beyond_float_range_names_the_field() -> None:
    """A JSON integer too large for a float raised OverflowError ("int too large to convert to
    float"), which named no field and is no ValueError (the server's parse did not catch it)."""
    huge = 10**400
    with pytest.raises(SamplingParamsError, match="^temperature="):
        SamplingParams.from_json(f'{{"temperature": {huge}}}')
    with pytest.raises(SamplingParamsError, match="^top_p="):
        SamplingParams(top_p=huge)  # type: ignore[arg-type]


def test_presence_and_frequency_penalties_accepted() -> None:
    p = SamplingParams.from_dict({"presence_penalty": "0.5", "frequency_penalty": -1})
    assert (p.presence_penalty, p.frequency_penalty, p.penalizes) == (0.5, -1.0, True)
    assert not SamplingParams().penalizes
    assert SamplingParams(repetition_penalty=1.1).penalizes
