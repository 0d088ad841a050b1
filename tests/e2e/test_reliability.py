"""Reliability against the real server, short enough for `make test`: a client that leaves a
non-streaming `/generate`, input errors that name the input, a huge prompt refused at once, the
server's max_tokens cap, and a drain on Ctrl-C through the launcher. The long runs (SIGTERM with
long streams, a killed stub, a killed launcher) are in test_soak.py."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.stream_client import build_inputs, error_message
from engine.serve import Server

from .conftest import ENGINE_OVERRIDES, finished, scrape, wait_for
from .launcher import OneStream, alive, start_launcher
from .test_triton_server import post_json

LONG = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}  # ~the whole 512 context


def idle(srv: Server) -> bool:
    m = scrape(srv)
    return bool(
        m["llm_num_requests_running"] == 0
        and m["llm_num_requests_waiting"] == 0
        and m["llm_kv_cache_usage_ratio"] <= 1e-9
    )


def assert_healthy(srv: Server) -> None:
    """Ready, nothing running, every KV slot free (evictable prefix cache counts as free)."""
    assert srv.is_ready()
    assert wait_for(lambda: idle(srv), timeout=10), scrape(srv)


def test_disconnected_generate_is_aborted_within_2s(server: Server) -> None:
    assert wait_for(lambda: idle(server), timeout=30)
    aborted = finished(scrape(server), "abort")
    body = json.dumps({"text_input": "Count from one:", "sampling_parameters": json.dumps(LONG)})
    conn = socket.create_connection(("127.0.0.1", server.http_port))
    conn.sendall(
        b"POST /v2/models/llm/generate HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    assert wait_for(lambda: scrape(server)["llm_num_requests_running"] == 1, timeout=10)
    time.sleep(0.5)  # decoding: Triton has not started the reply, so it cannot see the client go
    conn.close()
    left = time.monotonic()
    assert wait_for(lambda: idle(server), timeout=10, interval=0.05), scrape(server)
    took = time.monotonic() - left
    print(f"disconnected /generate aborted {took:.2f} s after the client left")
    assert took < 2.0
    assert finished(scrape(server), "abort") == aborted + 1
    assert_healthy(server)


def grpc_error(srv: Server, inputs: list[Any]) -> str:
    """The error message of one request on a gRPC stream (fails if it succeeds)."""
    errors: list[str] = []
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    client.start_stream(callback=lambda result, error: errors.append(str(error or "")))
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        assert wait_for(lambda: bool(errors), timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert errors[0], "expected an error response"
    return errors[0]


def test_invalid_utf8_names_the_input(server: Server) -> None:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"caf\xe9 \xff"], dtype=np.object_))
    message = grpc_error(server, [text])
    assert "text_input" in message and "UTF-8" in message, message
    assert server.is_ready()


BAD_INPUTS = {
    "empty prompt": ({"text_input": ""}, ["text_input"]),
    "bad sampling value": (
        {"text_input": "hi", "sampling_parameters": '{"top_p": 7}'},
        ["sampling_parameters", "top_p"],
    ),
    "max_tokens above the server's cap": (
        {"text_input": "hi", "sampling_parameters": '{"max_tokens": 5000}'},
        ["sampling_parameters", "max_tokens", str(ENGINE_OVERRIDES["max_tokens_cap"])],
    ),
    "prompt longer than the context": ({"text_input": "hello " * 700}, ["text_input", "context"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_input_errors_name_the_input(server: Server, case: str) -> None:
    body, needles = BAD_INPUTS[case]
    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(server, "generate", body)
    message = error_message(info.value.read().decode())
    assert all(n in message for n in needles), message
    assert server.is_ready()


def test_huge_prompt_is_refused_before_tokenizing(server: Server) -> None:
    prompt = "lorem ipsum " * 440_000  # 5.3 MB: tokenizing it took ~8 s
    began = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(server, "generate", {"text_input": prompt})
    took = time.monotonic() - began
    message = error_message(info.value.read().decode())
    print(f"5 MB prompt refused in {took:.2f} s: {message}")
    assert "text_input" in message and "characters" in message, message
    assert took < 3.0
    assert_healthy(server)


def test_ctrl_c_drains_then_exits_zero(tmp_path: Path) -> None:
    """The launcher as `make serve` runs it: a Ctrl-C with a stream in flight ends that stream
    with a 'server shutting down' error after the grace period, exits 0 on its own, leaves no
    process behind, and its log has no CUDA/NVML/DCGM noise on a CPU machine."""
    launcher = start_launcher(
        tmp_path / "serve.log", args=["--shutdown-grace", "2"], engine=ENGINE_OVERRIDES
    )
    try:
        launcher.wait_ready()
        pids = [*launcher.tritonservers(), *(s.pid for s in launcher.stubs())]
        assert len(pids) == 2, pids
        stream = OneStream(launcher.server.grpc_url, build_inputs("Count from one:", LONG))
        assert stream.wait_parts(3, timeout=60), stream.error
        began = time.monotonic()
        launcher.process.send_signal(signal.SIGINT)
        stream.wait_end(timeout=10)
        # NOTE: a gRPC stream left open after its last response keeps Triton 2.51 from
        # unloading the model (the launcher then kills it after grace + 5 s); clients close it.
        stream.close()
        code = launcher.stop(None)
        took = time.monotonic() - began
    finally:
        if launcher.process.poll() is None:
            launcher.stop(signal.SIGKILL)
    print(f"Ctrl-C with a stream in flight: stopped in {took:.1f} s")
    assert code == 0, launcher.log()[-3000:]
    assert stream.error is not None and "shutting down" in stream.error, stream.error
    assert took < 2 + 5 + 3  # grace + the launcher's kill margin + slack
    assert not [pid for pid in pids if alive(pid)]
    log = launcher.log()
    assert "exited on its own" in log, log[-3000:]
    for noise in ("CUDA", "NVML", "DCGM", "pinned memory"):
        assert noise not in log, noise
