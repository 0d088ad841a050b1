"""End-to-end: the real tritonserver, the real model repository, the default model.

One server serves the whole session (see conftest.py). Tests run in file order; the metrics test
comes last so it sees the traffic of the others.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from client.stream_client import build_inputs, error_message, grpc_inputs, stream_grpc, stream_http
from engine import SamplingParams
from engine.serve import Server

from .conftest import MODEL_DIR, finished, scrape, wait_for

PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def offline_text(offline: Any, prompt: str, params: dict[str, Any]) -> str:
    return str(offline.generate([prompt], SamplingParams.from_dict(params))[0].text)


class GrpcStream:
    """One gRPC stream; responses are collected per request id until each one's final flag."""

    def __init__(self, srv: Server) -> None:
        self.client = grpcclient.InferenceServerClient(srv.grpc_url)
        self.responses: dict[str, list[Any]] = {}
        self.finals: dict[str, int] = {}
        self.errors: list[str] = []
        self.events: queue.Queue[str] = queue.Queue()
        self.client.start_stream(callback=self._on_result)

    def _on_result(self, result: Any, error: Any) -> None:
        if error is not None:
            self.errors.append(str(error))
            self.events.put("error")
            return
        response = result.get_response()
        self.responses.setdefault(response.id, []).append(result)
        if response.parameters["triton_final_response"].bool_param:
            self.finals[response.id] = self.finals.get(response.id, 0) + 1
        self.events.put(response.id)

    def send(self, request_id: str, fields: dict[str, Any]) -> None:
        self.client.async_stream_infer(
            "llm", grpc_inputs(fields), request_id=request_id, enable_empty_final_response=True
        )

    def wait_final(self, request_ids: list[str], timeout: float = 120.0) -> None:
        while not all(rid in self.finals for rid in request_ids):
            self.events.get(timeout=timeout)
            assert not self.errors, self.errors

    def text(self, request_id: str) -> str:
        parts = [r.as_numpy("text_output") for r in self.responses.get(request_id, [])]
        return "".join(p.reshape(-1)[0].decode() for p in parts if p is not None and p.size)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_grpc_stream_matches_offline(server: Server, offline: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = offline_text(offline, chat_prompt, GREEDY)
    fields = build_inputs("What is the capital of France?", GREEDY, chat=True)
    deltas = list(stream_grpc(server.grpc_url, fields))
    assert len(deltas) > 1, "expected a stream of several responses"
    assert "".join(deltas) == expected


def test_http_generate_stream_matches_offline(server: Server, offline: Any) -> None:
    expected = offline_text(offline, PROMPT, GREEDY)
    deltas = list(stream_http(server.http_url, build_inputs(PROMPT, GREEDY)))
    assert len(deltas) > 1
    assert "".join(deltas) == expected


def test_non_streaming_returns_one_response(server: Server, offline: Any) -> None:
    expected = offline_text(offline, PROMPT, GREEDY)
    stream = GrpcStream(server)
    try:
        stream.send("one", build_inputs(PROMPT, GREEDY, stream=False))
        stream.wait_final(["one"])
    finally:
        stream.close()
    assert len(stream.responses["one"]) == 1 and stream.finals["one"] == 1
    assert stream.text("one") == expected
    # HTTP generate, vllm_backend default for non-streaming: the prompt is prepended.
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(GREEDY)}
    out = post_json(server, "generate", body)
    assert out["text_output"] == PROMPT + expected


def test_http_generate_takes_a_request_id_and_parameters(server: Server) -> None:
    # The generate extension's "id" and sampling settings as request parameters (what
    # vllm_backend reads when there is no `sampling_parameters` input).
    body = {"id": "42", "text_input": PROMPT, "parameters": {"max_tokens": 4, "temperature": 0}}
    out = post_json(server, "generate", body)
    assert out["text_output"].startswith(PROMPT) and len(out["text_output"]) > len(PROMPT)


def test_logprobs_with_top_tokens(server: Server, offline: Any) -> None:
    """vllm_backend's `logprobs` output for vLLM's `"logprobs": 2`: per token the chosen and
    the two most likely tokens by id, each with its logprob, rank and text, as the offline
    engine scores them."""
    params = {**GREEDY, "max_tokens": 4, "logprobs": 2}
    ref = offline.generate([PROMPT], SamplingParams.from_dict(params))[0]
    body = {
        "text_input": PROMPT,
        "sampling_parameters": json.dumps(params),
        "return_logprobs": True,
        "exclude_input_in_output": True,
    }
    out = post_json(server, "generate", body)
    entries = json.loads(out["logprobs"]) if isinstance(out["logprobs"], str) else out["logprobs"]
    assert out["text_output"] == ref.text and len(entries) == len(ref.token_ids) == 4
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    for entry, token, logprob, top in zip(
        entries, ref.token_ids, ref.logprobs, ref.top_logprobs, strict=True
    ):
        assert entry[str(token)]["rank"] == 1  # greedy
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert set(entry) == {str(t) for t, _ in top} and len(entry) == 2
        for rank, (t, lp) in enumerate(top, start=1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-4)
            assert entry[str(t)]["decoded_token"] == tokenizer.decode([t])
    bad = {"text_input": PROMPT, "sampling_parameters": json.dumps({"logprobs": 50})}
    with pytest.raises(urllib.error.HTTPError) as err:
        post_json(server, "generate", bad)
    assert "logprobs=50: must be true, false or a count of top tokens in [0, 20]" in (
        err.value.read().decode()
    )


def test_n_sequences_come_back_one_value_each(server: Server, offline: Any) -> None:
    """`"n": 3` (vllm_backend's form): each output holds one value a sequence, the sequences
    those of the offline engine (seeded `seed + index`), streamed over gRPC and whole over HTTP
    generate."""
    params = {"n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    ref = [o.text for o in offline.generate([PROMPT], SamplingParams.from_dict(params))]
    assert len(ref) == 3 and len(set(ref)) > 1
    fields = {
        "text_input": PROMPT,
        "sampling_parameters": json.dumps(params),
        "return_finish_reason": True,
        "return_num_output_tokens": True,
        "exclude_input_in_output": True,
    }
    out = post_json(server, "generate", fields)
    assert out["text_output"] == ref
    assert out["finish_reason"] == ["length"] * 3 and out["num_output_tokens"] == [5] * 3
    stream = GrpcStream(server)
    try:
        stream.send("n3", {**fields, "stream": True})
        stream.wait_final(["n3"])
    finally:
        stream.close()
    texts = ["", "", ""]
    counts = [0, 0, 0]
    for result in stream.responses["n3"]:
        parts = result.as_numpy("text_output")
        if parts is None:  # the final flag alone
            continue
        assert parts.shape == (3,)
        for i, (part, count) in enumerate(
            zip(parts, result.as_numpy("num_output_tokens"), strict=True)
        ):
            texts[i] += part.decode()
            counts[i] += int(count)
    assert texts == ref and counts == [5, 5, 5] and stream.finals["n3"] == 1
    last = stream.responses["n3"][-1].as_numpy("finish_reason")  # the final response's
    assert last is not None and [r.decode() for r in last] == ["length"] * 3


def test_concurrent_streams_complete(server: Server, offline: Any) -> None:
    prompts = [f"Write a word that rhymes with {w}:" for w in ("cat", "dog", "sun", "tree")] * 2
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs = offline.generate(prompts[:4], SamplingParams.from_dict(params))
    expected = [o.text for o in outs] * 2
    stream = GrpcStream(server)
    ids = [f"req-{i}" for i in range(len(prompts))]
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            fields = build_inputs(prompt, params)
            fields["return_num_output_tokens"] = True
            stream.send(rid, fields)
        stream.wait_final(ids)
    finally:
        stream.close()
    for rid, want in zip(ids, expected, strict=True):
        assert stream.finals[rid] == 1
        assert stream.text(rid) == want, rid
        counts = [r.as_numpy("num_output_tokens") for r in stream.responses[rid]]
        assert sum(int(c.sum()) for c in counts if c is not None) == 8


def test_cancel_frees_kv_slots(server: Server) -> None:
    assert wait_for(lambda: scrape(server)["llm_num_requests_running"] == 0)
    before = scrape(server)
    idle_kv = before["llm_kv_cache_usage_ratio"]
    aborted = finished(before, "abort")
    stream = GrpcStream(server)
    params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    stream.send("long", build_inputs("Count from one to a thousand:", params))
    assert wait_for(lambda: len(stream.responses.get("long", [])) >= 3, timeout=60)
    assert wait_for(lambda: scrape(server)["llm_num_requests_running"] >= 1)
    assert scrape(server)["llm_kv_cache_usage_ratio"] > idle_kv
    stream.close(cancel=True)

    def freed() -> bool:
        m = scrape(server)
        return bool(
            m["llm_num_requests_running"] == 0
            and m["llm_num_requests_waiting"] == 0
            and m["llm_kv_cache_usage_ratio"] <= idle_kv + 1e-9
        )

    assert wait_for(freed, timeout=15), scrape(server)
    after = scrape(server)
    assert finished(after, "abort") == aborted + 1
    assert "long" not in stream.finals or len(stream.responses["long"]) < 400
    # The server still serves.
    assert "".join(stream_grpc(server.grpc_url, build_inputs(PROMPT, GREEDY)))


BAD_REQUESTS = {
    "missing text_input": ({"stream": False}, "text_input"),
    "malformed sampling JSON": (
        {"text_input": "hi", "sampling_parameters": '{"max_tokens": 4,'},
        "not valid JSON",
    ),
    "unknown sampling key": (
        {"text_input": "hi", "sampling_parameters": '{"max_tokenz": 4}'},
        "max_tokenz",
    ),
    "invalid sampling value": (
        {"text_input": "hi", "sampling_parameters": '{"temperature": -1}'},
        "temperature",
    ),
    "prompt longer than the context": ({"text_input": "hello " * 700}, "context"),
    "stream without exclude_input_in_output": (
        {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
        "exclude_input_in_output",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_an_error_response(server: Server, case: str) -> None:
    body, needle = BAD_REQUESTS[case]
    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(server, "generate", body)
    message = error_message(info.value.read().decode())
    assert needle.lower() in message.lower(), message
    assert server.is_ready()


def test_bad_input_over_grpc_stream(server: Server) -> None:
    fields = build_inputs("hi", {"max_tokens": 4, "bogus": 1})
    with pytest.raises(RuntimeError, match="bogus"):
        list(stream_grpc(server.grpc_url, fields))
    assert server.is_ready()


def test_genai_perf_style_input(server: Server) -> None:
    # What `genai-perf --backend vllm` sends: numbers as strings, min_tokens with ignore_eos.
    fields: dict[str, Any] = {
        "text_input": "Tell me a story about a dragon.",
        "stream": True,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(
            {"max_tokens": "10", "min_tokens": "10", "ignore_eos": "true"}
        ),
        "return_num_output_tokens": True,
    }
    stream = GrpcStream(server)
    try:
        stream.send("gp", fields)
        stream.wait_final(["gp"])
    finally:
        stream.close()
    counts = [r.as_numpy("num_output_tokens") for r in stream.responses["gp"]]
    assert sum(int(c.sum()) for c in counts if c is not None) == 10
    assert stream.text("gp")


def test_metrics_after_traffic(server: Server) -> None:
    # traffic of its own, so that the test holds when run alone
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 4})}
    assert post_json(server, "generate", body)["text_output"]
    names = [
        "llm_prompt_tokens_total",
        "llm_generation_tokens_total",
        "llm_prefix_cache_queried_tokens_total",
        "llm_time_to_first_token_seconds_count",
        "llm_inter_token_latency_seconds_count",
        "llm_e2e_request_latency_seconds_count",
        "llm_request_queue_time_seconds_count",
        "llm_request_prefill_time_seconds_count",
        "llm_request_finished_total",
    ]
    assert wait_for(lambda: all(scrape(server).get(n, 0) > 0 for n in names), timeout=5)
    gauges = ("llm_num_requests_running", "llm_num_requests_waiting")
    assert wait_for(lambda: all(scrape(server)[g] == 0 for g in gauges), timeout=5)
    m = scrape(server)
    assert 0.0 <= m["llm_kv_cache_usage_ratio"] <= 1.0
    assert "llm_prefix_cache_hit_tokens_total" in m
    assert finished(m, "length") > 0
    # one series per model instance (gauges of several instances do not overwrite each other)
    running = [k for k in m if k.startswith("llm_num_requests_running{")]
    assert running and all('model_instance="llm' in k for k in running), running
    assert m["nv_inference_request_success"] > 0  # Triton's own metrics, same endpoint


def post_json(srv: Server, endpoint: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"http://{srv.http_url}/v2/models/llm/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())
