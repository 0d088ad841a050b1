"""Triton Python-backend model: a thin adapter from Triton requests to `engine.AsyncEngine`.

`execute()` parses each request and hands it to the engine; the engine's callbacks only put
deltas on a queue. One response thread builds and sends every `pb_utils.InferenceResponse`
(sending from several threads crashes the 2.51 Python backend under concurrency), checks for
cancelled requests and aborts them in the engine. Each request gets the final flag exactly once.
Inputs and outputs follow Triton's vllm_backend; see config.pbtxt.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.05
RETURN_FLAGS = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_cumulative_logprob",
    "return_logprobs",
)


class BadRequest(ValueError):
    """The request is malformed; the message goes back to the client."""


@dataclass
class Stream:
    """One in-flight request. Owned by the response thread once queued."""

    request_id: str
    sender: Any
    stream: bool
    returns: dict[str, bool]
    prefix: str = ""  # the prompt, when exclude_input_in_output is false (non-streaming only)
    arrival: float = field(default_factory=time.monotonic)
    texts: list[str] = field(default_factory=list)  # non-streaming: everything so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    num_output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    cancelled: bool = False


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must be decoupled")
        model_dir = Path(args["model_repository"])  # <root>/model_repository/llm
        repo_root = model_dir.resolve().parent.parent
        if str(repo_root) not in sys.path:
            sys.path.append(str(repo_root))  # a source checkout without `pip install -e .`

        from engine import AsyncEngine, EngineConfig
        from engine.metrics import MetricsExporter
        from engine.serve import engine_config_dict

        json_path = model_dir / args["model_version"] / "model.json"
        config = EngineConfig.from_dict(engine_config_dict(json_path, repo_root))
        pb_utils.Logger.log_info(f"llm: starting the engine with {config}")
        self.engine = AsyncEngine(config)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = MetricsExporter(pb_utils, labels, self.engine.stats)
        self.queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.active: dict[str, Stream] = {}  # touched only by the response thread
        self.thread = threading.Thread(
            target=self._response_loop, name="llm-responses", daemon=True
        )
        self.thread.start()

    # --- request side (Triton's execute thread) --------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, st = self._parse(request, sender)
            except Exception as e:  # BadRequest, SamplingParamsError, a bad parameters field
                self.queue.put(("error", (sender, str(e))))
                continue
            self.queue.put(("new", st))  # queued before any delta of this request can be
            try:
                self.engine.add_request(st.request_id, prompt, params, self._on_output)
            except Exception as e:  # ValueError: prompt too long for the context, ...
                self.queue.put(("rejected", (st.request_id, str(e))))
        return None

    def _on_output(self, out: Any) -> None:
        self.queue.put(("out", out))  # engine thread: keep it cheap

    def _parse(self, request: Any, sender: Any) -> tuple[str, Any, Stream]:
        from engine.sampling_params import SamplingParams

        prompt = _get_str(request, "text_input")
        if prompt is None:
            raise BadRequest("missing required input 'text_input'")
        if not prompt:
            raise BadRequest("'text_input' is empty")
        stream = _get_bool(request, "stream", False)
        exclude = _get_bool(request, "exclude_input_in_output", None)
        if stream and exclude is False:
            raise BadRequest(
                "exclude_input_in_output=false is not allowed with stream=true "
                "(a stream carries only new text)"
            )
        raw = _get_str(request, "sampling_parameters")
        if raw is None:  # vllm_backend also reads request parameters (HTTP generate body keys)
            extra = json.loads(request.parameters() or "{}")
            params = SamplingParams.from_dict(
                {k: v for k, v in extra.items() if not k.startswith("triton_")}
            )
        else:
            params = SamplingParams.from_json(raw)
        returns = {name: bool(_get_bool(request, name, False)) for name in RETURN_FLAGS}
        if returns["return_logprobs"] or returns["return_cumulative_logprob"]:
            params.logprobs = True
        if _get_bool(request, "apply_chat_template", False):
            messages = [{"role": "user", "content": prompt}]
            prompt = self.engine.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        st = Stream(uuid.uuid4().hex, sender, stream, returns)
        if not stream and not exclude:
            st.prefix = prompt  # vllm_backend's default for non-streaming requests
        return prompt, params, st

    # --- response side (the one thread that talks to pb_utils responses) -------------------------

    def _response_loop(self) -> None:
        next_poll = time.monotonic() + CANCEL_POLL_S
        while True:
            try:
                kind, item = self.queue.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                kind, item = "", None
            try:
                if kind == "stop":
                    return
                self._handle(kind, item)
                if time.monotonic() >= next_poll:
                    self._poll_cancelled()
                    next_poll = time.monotonic() + CANCEL_POLL_S
            except Exception as e:  # never let one bad send take the thread down
                pb_utils.Logger.log_error(f"llm: response thread: {e!r}")

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "new":
            self.active[item.request_id] = item
        elif kind == "error":
            sender, message = item
            sender.send(_error(message), flags=FINAL)
        elif kind == "rejected":
            request_id, message = item
            st = self.active.pop(request_id)
            st.sender.send(_error(message), flags=FINAL)
        elif kind == "out":
            st = self.active.get(item.request_id)
            if st is not None:
                self._on_delta(st, item)

    def _on_delta(self, st: Stream, out: Any) -> None:
        now = time.monotonic()
        if out.token_ids:
            if st.first_token_at is None:
                st.first_token_at = now
            else:
                gap = (now - st.last_token_at) / len(out.token_ids)
                st.gaps.extend([gap] * len(out.token_ids))
            st.last_token_at = now
            st.num_output_tokens += len(out.token_ids)
        if not out.finished:
            if st.cancelled:
                return
            if st.stream:
                if out.text or (out.token_ids and st.returns["return_num_output_tokens"]):
                    st.sender.send(self._response(st, out, out.text, len(out.token_ids)))
            else:
                st.texts.append(out.text)
            return
        # The final delta: the only place the final flag is sent.
        del self.active[st.request_id]
        self.metrics.observe_request(_timing(st, now))
        if out.error:
            st.sender.send(_error(out.error), flags=FINAL)
        elif st.cancelled:
            st.sender.send(flags=FINAL)
        elif st.stream:
            if out.text or any(st.returns.values()):
                st.sender.send(self._response(st, out, out.text, len(out.token_ids)), flags=FINAL)
            else:
                st.sender.send(flags=FINAL)  # nothing left to say; just close the stream
        else:
            text = st.prefix + "".join(st.texts) + out.text
            st.sender.send(self._response(st, out, text, st.num_output_tokens), flags=FINAL)

    def _poll_cancelled(self) -> None:
        for st in self.active.values():
            if not st.cancelled and st.sender.is_cancelled():
                st.cancelled = True
                self.engine.abort(st.request_id)  # its final delta (reason "abort") closes it

    def _response(self, st: Stream, out: Any, text: str, num_tokens: int) -> Any:
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if st.returns["return_finish_reason"]:
            reason = (out.finish_reason or "") if out.finished else ""
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason], dtype=np.object_)))
        if st.returns["return_num_input_tokens"]:
            n = np.array([out.num_prompt_tokens], dtype=np.uint32)
            tensors.append(pb_utils.Tensor("num_input_tokens", n))
        if st.returns["return_num_output_tokens"]:
            n = np.array([num_tokens], dtype=np.uint32)
            tensors.append(pb_utils.Tensor("num_output_tokens", n))
        if st.returns["return_cumulative_logprob"]:
            lp = np.array([out.cumulative_logprob], dtype=np.float32)
            tensors.append(pb_utils.Tensor("cumulative_logprob", lp))
        if st.returns["return_logprobs"]:
            new = [
                {str(t): {"logprob": p}} for t, p in zip(out.token_ids, out.logprobs, strict=False)
            ]
            st.logprobs.extend(new)
            chosen = new if st.stream else st.logprobs
            data = np.array([json.dumps(chosen).encode()], dtype=np.object_)
            tensors.append(pb_utils.Tensor("logprobs", data))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # --- shutdown ---------------------------------------------------------------------------------

    def finalize(self) -> None:
        # Triton calls this once in-flight requests are done (or its exit timeout ran out).
        for request_id in list(self.active):
            self.engine.abort(request_id)
        self.queue.put(("stop", None))
        self.thread.join(timeout=10)
        self.metrics.close()
        self.engine.shutdown()


def _error(message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def _timing(st: Stream, now: float) -> Any:
    from engine.metrics import RequestTiming

    ttft = None if st.first_token_at is None else st.first_token_at - st.arrival
    return RequestTiming(ttft=ttft, inter_token=st.gaps, e2e=now - st.arrival)


def _get_str(request: Any, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    if value.size == 0:
        return None
    item = value[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _get_bool(request: Any, name: str, default: bool | None) -> bool | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    return bool(value[0]) if value.size else default
