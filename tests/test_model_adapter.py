"""The Triton adapter (model_repository/llm/1/model.py) against a small fake of the Python
backend's utilities: what a real server cannot be stopped at the right moment for. Its requests,
streams and errors through a real tritonserver are tests/e2e's."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
FINAL = 1


class _Sender:
    def __init__(self) -> None:
        self.responses: list[tuple[Any, int]] = []
        self.finished = threading.Event()

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.responses.append((response, flags))
        if flags & FINAL:
            self.finished.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, inputs: dict[str, Any]) -> None:
        self.inputs = {k: types.SimpleNamespace(as_numpy=lambda v=v: np.array([v], dtype=object))
                       for k, v in inputs.items()}  # fmt: skip
        self.sender = _Sender()

    def get_response_sender(self) -> _Sender:
        return self.sender

    def parameters(self) -> str:
        return "{}"


def _fake_pb_utils() -> types.ModuleType:
    """The parts of `triton_python_backend_utils` the adapter and its metrics use."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    pb.TritonModelException = RuntimeError  # type: ignore[attr-defined]
    pb.using_decoupled_model_transaction_policy = lambda config: True  # type: ignore[attr-defined]
    quiet = staticmethod(lambda message: None)
    pb.Logger = type("Logger", (), {"log_info": quiet, "log_warn": quiet, "log_error": quiet})  # type: ignore[attr-defined]
    pb.TritonError = lambda message: types.SimpleNamespace(message=lambda: message)  # type: ignore[attr-defined]
    pb.Tensor = lambda name, array: (name, array)  # type: ignore[attr-defined]
    pb.InferenceResponse = lambda output_tensors=None, error=None: types.SimpleNamespace(  # type: ignore[attr-defined]
        output_tensors=output_tensors, error=error
    )
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)  # type: ignore[attr-defined]
    metric = types.SimpleNamespace(observe=lambda v: None, increment=lambda v: None,
                                   set=lambda v: None, value=lambda: 0)  # fmt: skip
    pb.MetricFamily = type(  # type: ignore[attr-defined]
        "MetricFamily",
        (),
        {
            "HISTOGRAM": "histogram", "COUNTER": "counter", "GAUGE": "gauge",
            "__init__": lambda self, **kw: None, "Metric": lambda self, **kw: metric,
        },
    )  # fmt: skip
    return pb


@pytest.fixture
def adapter(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's TritonPythonModel over a CPU engine in the stub's process."""
    import dataclasses

    import engine.config as engine_config
    import engine.serving.lifecycle as lifecycle

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    monkeypatch.setattr(lifecycle, "_hook_signals", lambda fd: False)  # pytest keeps its own
    load = engine_config.load_engine_config
    monkeypatch.setattr(
        engine_config,
        "load_engine_config",
        lambda path, root: dataclasses.replace(
            load(path, root), model=tiny_llama, device="cpu", dtype="float32",
            engine_process=False, max_total_tokens=4096, max_context_len=512,
        ),
    )  # fmt: skip
    spec = importlib.util.spec_from_file_location(
        "llm_adapter", REPO / "model_repository" / "llm" / "1" / "model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({
        "model_config": json.dumps({}), "model_repository": str(REPO / "model_repository" / "llm"),
        "model_version": "1", "model_name": "llm",
    })  # fmt: skip
    return model


def test_finalize_ends_requests_in_flight_once(adapter: Any) -> None:
    """A stream still running when the stub is finalized gets an error naming the shutdown
    with the final flag, exactly once, and nothing after it."""
    params = json.dumps({"max_tokens": 400, "ignore_eos": True, "temperature": 0})
    request = _Request({"text_input": b"Tell me a story", "stream": True,
                        "sampling_parameters": params.encode()})  # fmt: skip
    adapter.execute([request])
    deadline = time.monotonic() + 60
    while not request.sender.responses and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request.sender.responses, "no token streamed"
    adapter.finalize()
    flags = [f for _, f in request.sender.responses]
    assert flags.count(FINAL) == 1 and flags[-1] == FINAL, flags
    last = request.sender.responses[-1][0]
    assert last.error is not None and "server shutting down" in last.error.message()


def _model_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's TritonPythonModel class, not initialized (no engine)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location(
        "llm_adapter", REPO / "model_repository" / "llm" / "1" / "model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel


def test_chat_template_with_bos_gives_one_bos(
    default_tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek's template writes the BOS itself and its tokenizer adds one when encoding: the
    engine encodes the templated prompt with special tokens, so it started with two."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from engine.input_processor import InputProcessor

    model = _model_class(monkeypatch)()
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                    add_generation_prompt=True)  # fmt: skip
    model.engine = types.SimpleNamespace(tokenizer=tok)
    # The default model's template starts with its bos_token's text, which its tokenizer does
    # not add: that prompt is left as it is.
    assert plain.startswith(tok.bos_token) and model._chat("Hi") == plain
    bos, bos_id = tok.bos_token, tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)]
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}User: {{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    ids = InputProcessor(tok, tok.vocab_size, 512).tokenize(model._chat("Hi"))
    want = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                   add_generation_prompt=True, return_dict=True)  # fmt: skip
    assert ids[:2] != [bos_id, bos_id] and ids == list(want["input_ids"])


def test_chat_template_without_one_is_a_bad_request(
    default_tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply_chat_template on a model served without a tokenizer, or whose tokenizer has no
    template, is refused with the reason, not an AttributeError's text."""
    from transformers import AutoTokenizer

    from engine.serving.protocol import BadRequest

    model = _model_class(monkeypatch)()
    model.engine = types.SimpleNamespace(tokenizer=None)
    with pytest.raises(BadRequest, match="without a tokenizer"):
        model._chat("Hi")
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    tok.chat_template = None
    model.engine = types.SimpleNamespace(tokenizer=tok)
    with pytest.raises(BadRequest, match="no chat template"):
        model._chat("Hi")


class _CancelledSender(_Sender):
    def is_cancelled(self) -> bool:
        return True


def test_a_request_cancelled_while_it_is_added_is_aborted(
    adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves before the engine has its request (the prompt still tokenizing):
    the engine ignores an abort of an id it does not have, so the adapter aborts it once it is
    added, instead of letting it run to max_tokens."""
    outs: list[Any] = []
    add, on_output = adapter.engine.add_request, adapter._on_output

    def slow_add(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.3)  # the response thread polls cancellations every 50 ms meanwhile
        add(*args, **kwargs)

    monkeypatch.setattr(adapter.engine, "add_request", slow_add)
    monkeypatch.setattr(adapter, "_on_output", lambda out: (outs.append(out), on_output(out)))
    params = json.dumps({"max_tokens": 400, "ignore_eos": True, "temperature": 0})
    request = _Request({"text_input": b"Tell me a story", "stream": True,
                        "sampling_parameters": params.encode()})  # fmt: skip
    request.sender = _CancelledSender()
    adapter.execute([request])
    assert request.sender.finished.wait(60), "the request never ended"
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort", last
    assert sum(len(o.token_ids) for o in outs) < 400
    adapter.finalize()


def test_several_instances_leave_http_disconnects_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stub sees every CLOSE_WAIT socket on the server's port but only its own requests:
    with several instances a socket of another instance's request could abort one of this
    instance's, so the search is off there."""
    from engine.serving.disconnects import HttpDisconnects

    instances = _model_class(monkeypatch).initialize.__globals__["model_instances"]
    assert instances({"instance_group": [{"count": 1, "kind": "KIND_MODEL"}]}) == 1
    assert instances({}) == 1
    assert instances({"instance_group": [{"count": 2, "kind": "KIND_MODEL"}]}) == 2
    assert instances({"instance_group": [{"count": 1, "gpus": [0, 1]}, {"count": 1}]}) == 3
    assert HttpDisconnects.of_parent(2).port is None
    assert HttpDisconnects.of_parent(2).find({"r": 1.0}) == []


def test_an_engine_in_the_stub_ends_the_stub_when_it_dies(adapter: Any) -> None:
    """`engine_process: false`: a dead tensor-parallel worker ends the stub, as a dead engine
    process does, so the model does not stay ready while every request fails."""
    assert adapter.engine._on_dead == adapter._engine_died
    adapter.finalize()
