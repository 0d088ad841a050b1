"""The serving helpers without a server: engine settings from model.json + env, metrics, the
request protocol, finding HTTP clients that left, and the stub's drain and parent watch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, EngineConfig, engine_config_dict, load_engine_config
from engine.metrics import MetricsExporter, RequestTimer, RequestTiming
from engine.outputs import EngineStats, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.serve import REPO_ROOT
from engine.serving.disconnects import (
    HttpDisconnects,
    close_wait_times,
    match_disconnected,
    server_http_port,
)
from engine.serving.lifecycle import grace_from_env
from engine.serving.protocol import (
    RETURN_FLAGS,
    SPACE_MARKER,
    BadRequest,
    ParsedRequest,
    Reply,
    Stream,
    coalesce,
    parse_request,
    rejection,
    token_decoder,
)

HEAVY = ("torch", "transformers", "numpy", "tritonclient", "triton")


def imported_heavy(statement: str, bypass_engine_init: bool) -> list[str]:
    """The heavy packages a fresh interpreter has imported after `statement`."""
    setup = ""
    if bypass_engine_init:  # engine/__init__.py exports the engine's API and may import torch
        setup = (
            "import types; pkg = types.ModuleType('engine'); "
            f"pkg.__path__ = [{str(REPO_ROOT / 'engine')!r}]; sys.modules['engine'] = pkg; "
        )
    code = f"import sys; {setup}{statement}; print(sorted(set(sys.modules) & set({HEAVY!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().replace("'", '"')))


def test_launcher_and_serving_helpers_import_nothing_heavy() -> None:
    modules = ["engine.serve", "engine.config", "engine.serving.protocol", "engine.metrics"]
    assert imported_heavy(f"import {', '.join(modules)}", bypass_engine_init=True) == []


def test_launcher_import_is_light_once_engine_init_is() -> None:
    if imported_heavy("import engine", bypass_engine_init=False):
        pytest.skip("engine/__init__.py still imports torch eagerly")
    assert imported_heavy("import engine.serve", bypass_engine_init=False) == []


def write_json(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(values))
    return path


def test_shipped_model_json_is_a_valid_engine_config() -> None:
    path = REPO_ROOT / "model_repository" / "llm" / "1" / "model.json"
    config = EngineConfig.from_dict(engine_config_dict(path, REPO_ROOT, environ={}))
    assert config.model == str(REPO_ROOT / "models" / "smollm2-135m-instruct")
    assert config.device == "auto"


def test_env_overrides_are_typed(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"model": "m", "max_total_tokens": 1024})
    env = {
        "LLM_MAX_TOTAL_TOKENS": "none",
        "LLM_MAX_RUNNING_REQUESTS": "4",
        "LLM_MEM_FRACTION": "0.5",
        "LLM_ENABLE_CUDA_GRAPH": "false",
        "LLM_DEVICE": "cpu",
        "LLM_NOT_A_FIELD": "ignored",
    }
    values = engine_config_dict(path, tmp_path, environ=env)
    assert values == {
        "model": str(tmp_path / "m"),
        "max_total_tokens": None,
        "max_running_requests": 4,
        "mem_fraction": 0.5,
        "enable_cuda_graph": False,
        "device": "cpu",
    }
    EngineConfig.from_dict(values)


def test_absolute_model_path_is_kept(tmp_path: Path) -> None:
    path = write_json(tmp_path, {})
    values = engine_config_dict(path, tmp_path, environ={"LLM_MODEL": "/data/model"})
    assert values["model"] == "/data/model"


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    path = write_json(tmp_path, {})
    with pytest.raises(ValueError, match="LLM_MAX_RUNNING_REQUESTS"):
        engine_config_dict(path, tmp_path, environ={"LLM_MAX_RUNNING_REQUESTS": "many"})


def test_unknown_model_json_key_is_rejected_by_name(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"max_totl_tokens": 5})
    with pytest.raises(ConfigError, match="max_totl_tokens"):
        EngineConfig.from_dict(engine_config_dict(path, tmp_path, environ={}))


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"enable_overlap": "auto"}, "enable_overlap='auto'"),  # a truthy string: it read as on
        ({"max_running_requests": "32"}, "max_running_requests='32'"),
        ({"enable_cuda_graph": 1}, "enable_cuda_graph=1"),
    ],
)
def test_model_json_values_are_checked_against_their_types(
    tmp_path: Path, values: dict[str, Any], needle: str
) -> None:
    path = write_json(tmp_path, values)
    with pytest.raises(ConfigError, match=needle):
        load_engine_config(path, tmp_path, environ={})
    path = write_json(tmp_path, {"enable_overlap": None, "mem_fraction": 1})  # null, int as float
    assert load_engine_config(path, tmp_path, environ={}).enable_overlap is None


class FakeMetric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, v: float) -> None:
        self.value += v

    def set(self, v: float) -> None:
        self.value = v

    def observe(self, v: float) -> None:
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.metrics: list[FakeMetric] = []
        FakeFamily.made[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:
        metric = FakeMetric(labels)
        self.metrics.append(metric)
        return metric


class FakePbUtils:
    MetricFamily = FakeFamily


def stats(prompt: int, gen: int, finished: dict[str, int], running: int = 0) -> EngineStats:
    return EngineStats(running, 0, 0.25, prompt, gen, 0, prompt, finished)


def test_metrics_exporter_publishes_differences() -> None:
    snapshots = [stats(10, 5, {"length": 1}, running=1), stats(30, 9, {"length": 2, "stop": 1})]
    current = iter(snapshots)
    last = [snapshots[0]]

    def stats_fn() -> EngineStats:
        last[0] = next(current, last[0])
        return last[0]

    exporter = MetricsExporter(FakePbUtils(), {"model": "llm"}, stats_fn, interval_s=0.01)
    exporter.observe_request(RequestTiming(ttft=0.1, inter_token=[0.02, 0.03], e2e=0.2))
    exporter.observe_request(RequestTiming(ttft=0.3, e2e=0.5, queue_time=0.05, prefill_time=0.125))
    time.sleep(0.1)
    exporter.close()
    made = FakeFamily.made
    assert made["llm_prompt_tokens_total"].metrics[0].value == 30
    assert made["llm_generation_tokens_total"].metrics[0].value == 9
    assert made["llm_num_requests_running"].metrics[0].value == 0
    assert made["llm_kv_cache_usage_ratio"].metrics[0].value == 0.25
    by_reason = {m.labels["reason"]: m.value for m in made["llm_request_finished_total"].metrics}
    assert by_reason == {"stop": 1, "length": 2, "abort": 0}
    assert made["llm_time_to_first_token_seconds"].metrics[0].observed == [0.1, 0.3]
    assert made["llm_inter_token_latency_seconds"].metrics[0].observed == [0.02, 0.03]
    # the engine's stages: only the request whose final delta carried them
    assert made["llm_request_queue_time_seconds"].metrics[0].observed == [0.05]
    assert made["llm_request_prefill_time_seconds"].metrics[0].observed == [0.125]


def test_metrics_exporter_publishes_stats_under_steady_traffic() -> None:
    """Requests finishing more often than the interval do not hold the engine's counters and
    gauges back: they go out every interval."""
    generated = [0]

    def stats_fn() -> EngineStats:
        generated[0] += 1
        return stats(10, generated[0], {"length": 1})

    FakeFamily.made.clear()
    exporter = MetricsExporter(FakePbUtils(), {"model": "llm"}, stats_fn, interval_s=0.05)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # a request's timing every 10 ms
        exporter.observe_request(RequestTiming(ttft=0.1, e2e=0.2))
        time.sleep(0.01)
    published = FakeFamily.made["llm_generation_tokens_total"].metrics[0].value
    exporter.close()
    assert published >= 5, published  # about 12 intervals; none went out before the fix


def test_request_timer_splits_a_multi_token_delta() -> None:
    timer = RequestTimer(arrival=10.0)
    timer.on_tokens(1, now=10.5)
    timer.on_tokens(2, now=10.7)
    timing = timer.timing(now=11.0)
    assert timing.ttft == 0.5 and timing.e2e == 1.0
    assert timing.inter_token == pytest.approx([0.1, 0.1])
    assert timing.queue_time is None and timing.prefill_time is None


def test_request_timer_times_each_sequence_apart() -> None:
    timer = RequestTimer(arrival=10.0)
    for step in range(3):  # two sequences, a token each every 0.1 s, reported one after another
        timer.on_tokens(1, now=10.5 + 0.1 * step, index=0)
        timer.on_tokens(1, now=10.5 + 0.1 * step + 0.001, index=1)
    timing = timer.timing(now=11.0)
    assert timing.ttft == 0.5
    assert timing.inter_token == pytest.approx([0.1] * 4)


def test_request_timer_takes_the_engine_stages() -> None:
    timer = RequestTimer(arrival=10.0)
    timer.on_tokens(1, now=10.5)
    engine = RequestMetrics(arrival=10.1, first_scheduled=10.15, first_token=10.4, finished=10.9)
    timing = timer.timing(now=11.0, engine=engine)
    assert timing.queue_time == pytest.approx(0.05)
    assert timing.prefill_time == pytest.approx(0.25)
    unscheduled = timer.timing(now=11.0, engine=RequestMetrics(arrival=10.1, finished=10.2))
    assert unscheduled.queue_time is None and unscheduled.prefill_time is None


# --- the request/response protocol (engine.serving.protocol) ------------------------------------


def getter(values: dict[str, Any]) -> Any:
    return lambda name: values.get(name)


def parse(values: dict[str, Any], parameters: str = "") -> ParsedRequest:
    return parse_request(getter(values), parameters, lambda p: f"<user>{p}</user>")


def test_parse_request_defaults_follow_vllm_backend() -> None:
    req = parse({"text_input": b"Hi", "sampling_parameters": b'{"max_tokens": "5"}'})
    assert (req.prompt, req.stream, req.prefix, req.params.max_tokens) == ("Hi", False, "Hi", 5)
    req = parse({"text_input": b"Hi", "stream": True, "apply_chat_template": True})
    assert (req.prompt, req.prefix) == ("<user>Hi</user>", "")
    # HTTP generate's other body keys (its request id, KServe's priority and timeout) and
    # Triton's own parameters are not sampling settings; a misspelt setting is still refused.
    extra = '{"max_tokens": 3, "id": "42", "priority": 1, "timeout": 900, "triton_x": 1}'
    req = parse({"text_input": b"Hi"}, parameters=extra)
    assert req.params.max_tokens == 3
    with pytest.raises(BadRequest, match="request parameters: unknown sampling parameter 'ids'"):
        parse({"text_input": b"Hi"}, parameters='{"ids": "42"}')


@pytest.mark.parametrize(
    ("values", "needles"),
    [
        ({}, ["text_input", "missing"]),
        ({"text_input": b""}, ["text_input", "empty"]),
        ({"text_input": b"caf\xe9"}, ["text_input", "UTF-8"]),
        ({"text_input": b"hi", "sampling_parameters": b"{"}, ["sampling_parameters", "JSON"]),
        ({"text_input": b"hi", "sampling_parameters": b'{"top_k": "x"}'}, ["sampling_", "top_k"]),
        ({"text_input": b"hi", "sampling_parameters": b"\xff"}, ["sampling_parameters", "UTF-8"]),
    ],
)
def test_parse_errors_name_the_input(values: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(BadRequest) as info:
        parse(values)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_engine_errors_name_the_input() -> None:
    assert rejection(SamplingParamsError("max_tokens=9 is above")).startswith(
        "input 'sampling_parameters'"
    )
    assert rejection(ValueError("prompt has 900 tokens")).startswith("input 'text_input'")
    assert rejection(RuntimeError("the engine is shut down")) == "the engine is shut down"


def test_stream_replies() -> None:
    returns = dict.fromkeys(RETURN_FLAGS, False)
    whole = Stream("r", None, ParsedRequest("P", SamplingParams(), False, returns, prefix="P"))
    assert whole.on_deltas([RequestOutput("r", text=" a", token_ids=[1])]) is None
    assert whole.unanswered
    reply = whole.on_deltas([RequestOutput("r", text=" b", token_ids=[2], finished=True)])
    assert reply is not None and reply.final
    assert reply.outputs == [("text_output", [b"P a b"], "object")]
    live = Stream("s", None, ParsedRequest("P", SamplingParams(), True, returns))
    reply = live.on_deltas([RequestOutput("s", text=" a", token_ids=[1])])
    assert reply is not None and not reply.final and not live.unanswered
    done = live.on_deltas([RequestOutput("s", finished=True, finish_reason="abort", error="boom")])
    assert done == Reply(final=True, error="boom")


def _logprob_deltas(rid: str, top: bool = False) -> list[RequestOutput]:
    """Four one-token deltas; the second's text is held back (part of a character). Token i+1
    is of rank i+1; with `top`, each step's two most likely are tokens 1 and 9."""
    texts = ["a", "", "\u00e9", "b"]
    return [
        RequestOutput(
            rid, text=t, token_ids=[i + 1], logprobs=[-0.1 * (i + 1)], logprob_ranks=[i + 1],
            top_logprobs=[[(1, -0.1), (9, -0.15)]] if top else [], finished=i == 3,
            finish_reason="length" if i == 3 else None,
        )
        for i, t in enumerate(texts)
    ]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_cover_every_token(stream: bool) -> None:
    """`return_logprobs` gives one entry a generated token: all of them at the end without
    streaming; streaming, each reply those since the last, a held-back token's with the next."""
    returns = dict.fromkeys(RETURN_FLAGS, False) | {"return_logprobs": True}
    s = Stream("r", None, ParsedRequest("P", SamplingParams(), stream, returns))
    replies = [s.on_deltas([d]) for d in _logprob_deltas("r")]
    sent = [
        json.loads(dict((n, v) for n, (v,), _ in r.outputs)["logprobs"])
        for r in replies
        if r is not None
    ]
    expected = [
        {str(i + 1): {"logprob": pytest.approx(-0.1 * (i + 1)), "rank": i + 1}} for i in range(4)
    ]
    assert [e for part in sent for e in part] == expected
    if stream:
        assert replies[1] is None and len(sent) == 3  # the held-back token's went with the next
    else:
        assert replies[:3] == [None, None, None] and len(sent) == 1


def test_logprobs_with_top_tokens_and_their_text() -> None:
    """vllm_backend's form: a token's entry holds the chosen and the top tokens by id, each
    with its logprob, rank and decoded text; a chosen token among the top appears once."""
    returns = dict.fromkeys(RETURN_FLAGS, False) | {"return_logprobs": True}
    req = ParsedRequest("P", SamplingParams(logprobs=True, top_logprobs=2), False, returns)
    s = Stream("r", None, req, decode_token=lambda t: f"<{t}>")
    replies = [s.on_deltas([d]) for d in _logprob_deltas("r", top=True)]
    assert replies[3] is not None and replies[3].outputs is not None
    sent = json.loads(dict((n, v) for n, (v,), _ in replies[3].outputs)["logprobs"])
    top = {
        "1": {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "<1>"},
        "9": {"logprob": pytest.approx(-0.15), "rank": 2, "decoded_token": "<9>"},
    }
    assert sent[0] == top  # token 1 was chosen: once
    chosen = {"logprob": pytest.approx(-0.3), "rank": 3, "decoded_token": "<3>"}
    assert sent[2] == top | {"3": chosen}
    assert len(sent) == 4
    ruled_out = RequestOutput(
        "q", token_ids=[7], logprobs=[float("-inf")], logprob_ranks=[50], finished=True
    )
    s = Stream("q", None, ParsedRequest("P", SamplingParams(logprobs=True), False, returns))
    reply = s.on_deltas([ruled_out])
    assert reply is not None and reply.outputs is not None
    sent = json.loads(dict((n, v) for n, (v,), _ in reply.outputs)["logprobs"])
    assert sent == [{"7": {"logprob": -9999.0, "rank": 50}}]  # strict JSON: no -Infinity


def test_token_decoder_decodes_each_id_alone_once() -> None:
    calls: list[list[int]] = []

    class Tokenizer:
        def decode(self, ids: list[int]) -> str:
            calls.append(ids)
            return f"t{ids[0]}"

    decode = token_decoder(Tokenizer())
    assert decode is not None and [decode(5), decode(5), decode(7)] == ["t5", "t5", "t7"]
    assert calls == [[5], [7]]
    assert token_decoder(None) is None


def test_token_decoder_puts_back_sentencepiece_leading_spaces() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    m = SPACE_MARKER
    pieces = ["<unk>", f"{m}hello", f"{m}world", "lo", m, f"{m}{m}x"]
    inner = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement=m, prepend_scheme="first")
    inner.decoder = decoders.Metaspace(replacement=m, prepend_scheme="first")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>")
    assert tokenizer.decode([2]) == "world"  # what decoding the id alone gives
    decode = token_decoder(tokenizer)
    assert decode is not None
    assert [decode(i) for i in range(6)] == ["<unk>", " hello", " world", "lo", " ", "  x"]
    assert tokenizer.decode([1, 2]) == "hello world"  # mid-sentence, " world" as reported


def test_token_decoder_keeps_byte_level_tokens_as_decoded(default_tokenizer: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer)
    decode = token_decoder(tokenizer)
    assert decode is not None
    ids = tokenizer.encode(" hello world, x  y", add_special_tokens=False)
    assert [decode(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    assert "".join(decode(t) for t in ids) == " hello world, x  y"


def test_stream_of_n_sequences_replies_one_value_a_sequence() -> None:
    returns = dict.fromkeys(RETURN_FLAGS, True)
    params = SamplingParams(n=2, logprobs=True)

    def delta(i: int, text: str, token: int, **kw: Any) -> RequestOutput:
        return RequestOutput(
            "r", text=text, token_ids=[token], logprobs=[-0.5], logprob_ranks=[1],
            num_prompt_tokens=3, cumulative_logprob=-0.5 * token, index=i, **kw,
        )  # fmt: skip

    whole = Stream("r", None, ParsedRequest("P", params, False, returns, prefix="P"))
    assert whole.on_deltas([delta(0, " a", 1)]) is None
    assert whole.on_deltas([delta(1, " b", 2)]) is None
    assert whole.on_deltas([delta(1, " c", 3, finish_reason="length")]) is None
    reply = whole.on_deltas([delta(0, " d", 4, finish_reason="stop", finished=True)])
    assert reply is not None and reply.final and reply.outputs is not None
    got = {name: values for name, values, _ in reply.outputs}
    assert got["text_output"] == [b"P a d", b"P b c"]
    assert got["finish_reason"] == ["stop", "length"]
    assert got["num_input_tokens"] == [3] and got["num_output_tokens"] == [2, 2]
    assert got["cumulative_logprob"] == [-2.0, -1.5]
    assert [len(json.loads(v)) for v in got["logprobs"]] == [2, 2]

    live = Stream("r", None, ParsedRequest("P", params, True, returns))
    replies = [
        live.on_deltas([d])
        for d in (
            delta(0, " a", 1), delta(1, " b", 2), delta(1, "", 3, finish_reason="length"),
            delta(0, " d", 4, finish_reason="stop", finished=True),
        )
    ]  # fmt: skip
    sent = [{n: v for n, v, _ in r.outputs} for r in replies if r and r.outputs]
    assert [r.final for r in replies if r] == [False, False, False, True]
    assert [s["text_output"] for s in sent] == [
        [b" a", b""],
        [b"", b" b"],
        [b"", b""],
        [b" d", b""],
    ]
    assert [s["finish_reason"] for s in sent] == [
        ["", ""], ["", ""], ["", "length"], ["stop", "length"]
    ]  # fmt: skip
    assert [s["num_output_tokens"] for s in sent] == [[1, 0], [0, 1], [0, 1], [1, 0]]
    assert [[len(json.loads(v)) for v in s["logprobs"]] for s in sent] == [
        [1, 0], [0, 1], [0, 1], [1, 0]
    ]  # fmt: skip


def test_coalesce_gathers_a_requests_sequences_final_last() -> None:
    a0 = RequestOutput("a", text="x", token_ids=[1])
    a1 = RequestOutput("a", text="y", token_ids=[2], index=1)
    a0_end = RequestOutput("a", text="z", token_ids=[3], finish_reason="stop", finished=True)
    b = RequestOutput("b", text="w", token_ids=[4])
    merged = coalesce([("out", a0), ("out", a1), ("out", b), ("out", a0_end)])
    assert [[(d.request_id, d.index, d.text, d.finished) for d in ds] for _, ds in merged] == [
        [("b", 0, "w", False)], [("a", 1, "y", False), ("a", 0, "xz", True)]
    ]  # fmt: skip
    a1_more = RequestOutput("a", text="v", token_ids=[5], index=1)
    ((_, ds),) = coalesce([("out", a1), ("out", a0), ("out", a1_more)])
    assert [(d.index, d.text) for d in ds] == [(0, "x"), (1, "yv")]
    # one reply for both sequences: each one's new text in its place
    returns = dict.fromkeys(RETURN_FLAGS, False)
    live = Stream("a", None, ParsedRequest("P", SamplingParams(n=2), True, returns))
    reply = live.on_deltas(ds)
    assert reply is not None and reply.outputs == [("text_output", [b"x", b"yv"], "object")]


def test_coalesce_merges_each_requests_queued_deltas() -> None:
    a1 = RequestOutput(
        "a", text="He", token_ids=[1], logprobs=[-0.1], logprob_ranks=[2],
        top_logprobs=[[(5, -0.05)]], num_output_tokens=1,
    )  # fmt: skip
    b1 = RequestOutput("b", text="x", token_ids=[7], num_output_tokens=1)
    a2 = RequestOutput(
        "a", text="llo", token_ids=[2, 3], logprobs=[-0.2, -0.3], logprob_ranks=[1, 4],
        top_logprobs=[[(2, -0.2)], [(6, -0.1)]], num_output_tokens=3,
    )  # fmt: skip
    a3 = RequestOutput(
        "a", text="!", token_ids=[4], logprobs=[-0.4], logprob_ranks=[3], finished=True,
        finish_reason="length",
        num_output_tokens=4, cumulative_logprob=-1.0,
    )  # fmt: skip
    new_c = object()
    events = [("out", a1), ("out", b1), ("new", new_c), ("out", a2), ("out", a3)]
    merged = coalesce(events)
    assert [k for k, _ in merged] == ["out", "new", "out"]  # each request at its last delta
    ((a,),) = [ds for k, ds in merged if k == "out" and ds[0].request_id == "a"]
    assert (a.request_id, a.text, a.token_ids) == ("a", "Hello!", [1, 2, 3, 4])
    assert a.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert a.logprob_ranks == [2, 1, 4, 3]
    assert a.top_logprobs == [[(5, -0.05)], [(2, -0.2)], [(6, -0.1)]]
    assert a.finished and a.finish_reason == "length" and a.num_output_tokens == 4
    assert a.cumulative_logprob == -1.0
    assert merged[0] == ("out", [b1]) and merged[1] == ("new", new_c)
    # a request's "new" stays ahead of its deltas; nothing after a stop is handled
    c1 = RequestOutput("c", text="y", token_ids=[9])
    assert coalesce([("new", new_c), ("out", c1), ("stop", None), ("out", b1)]) == [
        ("new", new_c), ("out", [c1]), ("stop", None),
    ]  # fmt: skip
    # merged, a stream replies once with all the text, and the timer counts every token
    returns = dict.fromkeys(RETURN_FLAGS, False) | {"return_num_output_tokens": True}
    live = Stream("a", None, ParsedRequest("P", SamplingParams(), True, returns))
    reply = live.on_deltas([a])
    assert reply is not None and reply.final
    assert reply.outputs == [
        ("text_output", [b"Hello!"], "object"),
        ("num_output_tokens", [4], "uint32"),
    ]
    assert live.seqs[0].num_output_tokens == 4


# --- HTTP clients that left (engine.serving.disconnects) --------------------------------------


def test_match_disconnected_needs_one_candidate_near_the_socket_time() -> None:
    assert match_disconnected({"a": 10.003, "b": 4.0}, [10.0]) == ["a"]
    assert match_disconnected({"a": 10.003, "b": 10.2}, [10.0]) == []  # ambiguous: abort none
    assert match_disconnected({"a": 9.5}, [10.0]) == []  # arrived before the socket's data
    assert match_disconnected({}, [10.0]) == []


def test_close_wait_times_sees_a_client_that_left() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        with conn:
            sent = time.monotonic()
            client.sendall(b"POST /v2/models/llm/generate HTTP/1.1\r\n\r\n")
            time.sleep(0.2)
            assert close_wait_times(port) == {}  # still connected
            disconnects = HttpDisconnects(port)
            assert disconnects.find({"r": sent + 0.002}) == []
            client.close()
            time.sleep(0.05)
            (received,) = close_wait_times(port).values()
            assert abs(received - sent) < 0.05
            assert disconnects.find({"r": sent + 0.002}) == []  # seen once: maybe closing
            assert disconnects.find({"r": sent + 0.002}) == ["r"]


def test_server_http_port_from_its_command_line() -> None:
    assert server_http_port(os.getpid()) == 8000  # pytest has no --http-port: Triton's default
    assert HttpDisconnects(None).find({"r": 1.0}) == []


# --- the stub's lifecycle (engine.serving.lifecycle), in child processes ------------------------


def test_grace_from_env() -> None:
    assert grace_from_env({}) == 10.0
    assert grace_from_env({"LLM_SHUTDOWN_GRACE_S": "2.5"}) == 2.5
    with pytest.raises(ValueError, match="LLM_SHUTDOWN_GRACE_S"):
        grace_from_env({"LLM_SHUTDOWN_GRACE_S": "soon"})
    for bad in ("nan", "inf", "-1"):  # nan would never end a drain
        with pytest.raises(ValueError, match="finite number of seconds >= 0"):
            grace_from_env({"LLM_SHUTDOWN_GRACE_S": bad})


@pytest.mark.parametrize(
    "argv",
    [
        ["--http-port", "70000"],
        ["--grpc-port", "0"],
        ["--http-port", "9000", "--metrics-port", "9000"],
        ["--shutdown-grace", "nan"],
        ["--shutdown-grace", "-5"],
    ],
)
def test_the_launcher_refuses_bad_ports_and_grace(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean usage error (exit 2) before anything starts, not a traceback from bind() or
    int(nan), nor a grace every model stub would refuse later."""
    from engine.serving.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_bad_grace_variable_is_a_usage_error_unless_the_flag_overrides_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import engine.serving.cli as cli

    monkeypatch.setenv("LLM_SHUTDOWN_GRACE_S", "abc")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2 and "LLM_SHUTDOWN_GRACE_S" in capsys.readouterr().err
    monkeypatch.setattr(cli, "find_tritonserver", lambda: None)  # stop right after the parse
    assert cli.main(["--shutdown-grace", "5"]) == 2
    assert "tritonserver not found" in capsys.readouterr().err


def run_python(code: str, timeout: float = 30) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True
    )
    return out.stdout


def test_sigterm_starts_a_drain() -> None:
    code = (
        "import os, signal, time\n"
        "from engine.serving.lifecycle import ServerLifecycle\n"
        "life = ServerLifecycle(grace_s=3.0)\n"
        "assert life.signals_hooked and not life.draining\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "t = time.monotonic()\n"
        "while not life.draining and time.monotonic() - t < 5: time.sleep(0.01)\n"
        "print(life.draining, round(life.drain_deadline - time.monotonic()))\n"
    )
    assert run_python(code).split() == ["True", "3"]


def test_an_orphaned_stub_ends_itself() -> None:
    # The child starts a grandchild that watches its parent, prints its pid and waits; the child
    # then exits, as a killed tritonserver would.
    grandchild = (
        "import time; from engine.serving.lifecycle import ServerLifecycle; "
        "ServerLifecycle(grace_s=1.0, poll_s=0.1); print('up', flush=True); time.sleep(60)"
    )
    code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE)\n"
        "p.stdout.readline()\n"
        "print(p.pid)\n"
    )
    pid = int(run_python(code))
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_hung_orphaned_stub_is_ended_from_outside() -> None:
    """A stub whose threads can no longer run Python once its server is gone (one holds the GIL,
    blocked for good) is killed by its watchdog process, with the process it started."""
    grandchild = (
        "import ctypes, subprocess, sys, time\n"
        "from engine.serving.lifecycle import ServerLifecycle\n"
        "ServerLifecycle(grace_s=1.0, poll_s=0.1)\n"
        "engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(engine.pid, flush=True)\n"
        "ctypes.PyDLL(None).sleep(60)\n"  # (a C call made holding the GIL: no thread runs)
    )
    code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE)\n"
        "print(p.pid, p.stdout.readline().decode().strip())\n"
    )
    pids = [int(p) for p in run_python(code).split()]
    deadline = time.monotonic() + 5
    while any(_lives(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_lives(p) for p in pids), pids


def _lives(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- AsyncEngine's checks before any work is queued ---------------------------------------------


def test_async_engine_refuses_before_tokenizing(tiny_llama: str) -> None:
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=tiny_llama, device="cpu", max_tokens_cap=64))
    try:
        with pytest.raises(SamplingParamsError, match="max_tokens_cap"):
            engine.add_request("a", "hi", SamplingParams(max_tokens=65), lambda out: None)
        huge = "lorem ipsum " * 440_000  # 5.3 MB
        began = time.monotonic()
        with pytest.raises(ValueError, match="characters"):
            engine.add_request("b", huge, SamplingParams(), lambda out: None)
        assert time.monotonic() - began < 0.5
        assert engine.core.inputs.max_prompt_chars < len(huge)
    finally:
        engine.shutdown()


def test_checkpoint_without_tokenizer_is_a_clear_error(tiny_llama: str, tmp_path: Path) -> None:
    from engine.async_engine import AsyncEngine

    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(Path(tiny_llama) / name)
    with pytest.raises(ConfigError, match="no tokenizer files"):
        AsyncEngine(EngineConfig(model=str(tmp_path), device="cpu"))
    from engine import LLM

    with pytest.raises(ConfigError, match="no tokenizer files"):  # the offline engine too
        LLM(str(tmp_path), device="cpu")


def test_max_tokens_cap_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_tokens_cap"):
        EngineConfig(max_tokens_cap=0)
