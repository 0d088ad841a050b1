"""Triton Python-backend model: a thin adapter from Triton requests to the engine (by default in
a child process: engine.engine_process; `engine_process: false` runs `AsyncEngine` in the stub).

`execute()` parses each request and hands it to the engine; the engine's callbacks only put
deltas on a queue. One response thread builds and sends every `pb_utils.InferenceResponse`
(sending from several threads crashes the 2.51 Python backend under concurrency). It takes
everything queued at once and merges each request's deltas into one response (a thread that
fell behind catches up). It also aborts the requests whose client left (`is_cancelled()`, or an
HTTP client Triton did not see leave: engine.serving.disconnects) and, once a drain began
(SIGTERM to the stub: engine.serving.lifecycle), refuses new requests and ends those still
running after the grace period with an error. Each request gets the final flag exactly once.
Parsing and what to send for each delta live in engine.serving.protocol (vllm_backend's inputs
and outputs; see config.pbtxt).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.05
MAX_EVENTS = 4096  # events taken off the queue at once
DISCONNECT_POLL_S = 0.25
SHUTTING_DOWN = "server shutting down"


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must be decoupled")
        model_dir = Path(args["model_repository"])  # <root>/model_repository/llm
        repo_root = model_dir.resolve().parent.parent
        if str(repo_root) not in sys.path:
            sys.path.append(str(repo_root))  # a source checkout without `pip install -e .`

        from engine.async_engine import AsyncEngine
        from engine.config import load_engine_config
        from engine.engine_process import EngineProcess
        from engine.metrics import MetricsExporter
        from engine.serving.disconnects import HttpDisconnects
        from engine.serving.lifecycle import ServerLifecycle, grace_from_env
        from engine.serving.protocol import token_decoder

        self.lifecycle = ServerLifecycle(grace_from_env())  # before the load: a stop drains too
        instances = model_instances(model_config)
        self.disconnects = HttpDisconnects.of_parent(instances)
        if instances > 1:
            pb_utils.Logger.log_info(
                f"llm: {instances} instances: HTTP clients that leave unseen are not searched for"
            )
        config = load_engine_config(model_dir / args["model_version"] / "model.json", repo_root)
        # numpy's version and place: the stub's own numpy code breaks under numpy 2 when it was
        # built for numpy 1 (docs/SERVING.md, "On the H200").
        pb_utils.Logger.log_info(f"llm: numpy {np.__version__} from {np.__file__}")
        pb_utils.Logger.log_info(f"llm: starting the engine with {config}")
        if config.engine_process:
            self.engine: Any = EngineProcess(config, on_died=self._engine_died)
            pb_utils.Logger.log_info(f"llm: the engine runs in process {self.engine.pid}")
        else:
            # (a dead tensor-parallel worker ends the stub here too, as a dead engine process
            # does: the model must not stay ready while every request fails)
            self.engine = AsyncEngine(config, on_dead=self._engine_died)
        self._decode_token = token_decoder(self.engine.tokenizer)
        # NOTE: one series per model instance (instance_group count > 1 runs an engine each):
        # with model and version alone, each instance's gauges overwrote the others'.
        labels = {"model": args["model_name"], "version": args["model_version"]}
        labels["model_instance"] = args.get("model_instance_name", "")
        self.metrics = MetricsExporter(pb_utils, labels, self.engine.stats)
        self.queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.active: dict[str, Any] = {}  # id -> protocol.Stream; only the response thread
        self.thread = threading.Thread(target=self._loop, name="llm-responses", daemon=True)
        self.thread.start()

    # --- request side (Triton's execute thread) --------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        from engine.metrics import RequestTimer
        from engine.serving.protocol import Stream, parse_request, rejection

        for request in requests:
            timer = RequestTimer()
            sender = request.get_response_sender()
            if self.lifecycle.draining:
                self.queue.put(("error", (sender, f"{SHUTTING_DOWN}: request not accepted")))
                continue
            try:
                req = parse_request(_getter(request), request.parameters(), self._chat)
            except Exception as e:  # BadRequest, SamplingParamsError, a bad parameters field
                self.queue.put(("error", (sender, str(e))))
                continue
            st = Stream(uuid.uuid4().hex, sender, req, timer, self._decode_token)
            self.queue.put(("new", st))  # queued before any delta of this request can be
            try:
                self.engine.add_request(st.request_id, req.prompt, req.params, self._on_output)
            except Exception as e:  # ValueError: prompt too long for the context, ...
                self.queue.put(("rejected", (st.request_id, rejection(e))))
            else:
                self.queue.put(("added", st.request_id))
        return None

    def _chat(self, prompt: str) -> str:
        from engine.serving.protocol import BadRequest

        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            why = (
                "the model is served without a tokenizer"
                if tokenizer is None
                else ("the model's tokenizer has no chat template")
            )
            raise BadRequest(f"apply_chat_template: {why}")
        messages = [{"role": "user", "content": prompt}]
        text: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # NOTE: the engine encodes a text prompt with special tokens. A template that writes the
        # BOS itself (DeepSeek's) for a tokenizer that adds one would start with two BOS; vLLM's
        # and SGLang's chat paths add none beyond the template's.
        bos = tokenizer.bos_token
        if bos and text.startswith(bos) and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
            text = text[len(bos) :]
        return text

    def _engine_died(self, reason: str) -> None:
        # Its requests have ended with an error; this stub cannot serve again, so it ends, and
        # the server reports the model unavailable (`python -m engine.serve` restarts it).
        pb_utils.Logger.log_error(f"llm: {reason}; ending the stub")
        time.sleep(0.5)  # let the response thread send those errors
        os.kill(os.getpid(), signal.SIGKILL)

    def _on_output(self, out: Any) -> None:
        self.queue.put(("out", out))  # engine thread: keep it cheap

    # --- response side (the one thread that talks to pb_utils responses) -------------------------

    def _loop(self) -> None:
        from engine.serving.protocol import coalesce

        next_poll = time.monotonic() + CANCEL_POLL_S
        self._next_disconnect_check = 0.0
        while True:
            events = []
            try:
                events.append(self.queue.get(timeout=CANCEL_POLL_S))
                while len(events) < MAX_EVENTS:  # all that queued up: one send per request
                    events.append(self.queue.get_nowait())
            except queue.Empty:
                pass
            for kind, item in coalesce(events):
                if kind == "stop":
                    self._end_all(f"{SHUTTING_DOWN}: request ended")
                    return
                try:
                    self._handle(kind, item)
                except Exception as e:  # never let one bad send take the thread down
                    pb_utils.Logger.log_error(f"llm: response thread: {e!r}")
            try:
                if time.monotonic() >= next_poll:
                    self._poll()
                    next_poll = time.monotonic() + CANCEL_POLL_S
            except Exception as e:
                pb_utils.Logger.log_error(f"llm: response thread: {e!r}")

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "new":
            self.active[item.request_id] = item
        elif kind == "error":
            sender, message = item
            sender.send(_error(message), flags=FINAL)
        elif kind == "added":
            # NOTE: the engine ignores an abort of an id it does not have yet, so a request
            # cancelled (or ended by a drain) while it was being tokenized is aborted only now.
            st = self.active.get(item)
            if st is None:  # ended already (or finished): an abort of a finished id is a no-op
                self.engine.abort(item)
            else:
                st.added = True
                if st.cancelled:
                    self.engine.abort(item)
        elif kind == "rejected":
            request_id, message = item
            self.active.pop(request_id).sender.send(_error(message), flags=FINAL)
        elif kind == "out":  # (a request's deltas, gathered by `coalesce`)
            st = self.active.get(item[0].request_id)
            if st is not None:
                self._on_deltas(st, item)

    def _on_deltas(self, st: Any, outs: list[Any]) -> None:
        reply = st.on_deltas(outs)
        if reply is None:
            return
        if reply.final:  # the only place the final flag is sent
            del self.active[st.request_id]
            self.metrics.observe_request(st.timer.timing(engine=outs[-1].metrics))
        if reply.error is not None:
            response = _error(reply.error)
        elif reply.outputs is None:
            response = None
        else:
            tensors = [
                pb_utils.Tensor(n, np.array(values, dtype=t)) for n, values, t in reply.outputs
            ]
            response = pb_utils.InferenceResponse(output_tensors=tensors)
        st.sender.send(response, flags=FINAL if reply.final else 0)

    def _poll(self) -> None:
        now, deadline = time.monotonic(), self.lifecycle.drain_deadline
        if deadline is not None and now >= deadline:
            message = f"{SHUTTING_DOWN}: request ended after the {self.lifecycle.grace_s:g} s grace"
            self._end_all(message)
        for st in self.active.values():
            if not st.cancelled and st.sender.is_cancelled():
                self._cancel(st)
        if now >= self._next_disconnect_check:
            self._next_disconnect_check = now + DISCONNECT_POLL_S
            waiting = {r: s.timer.arrival for r, s in self.active.items() if s.unanswered}
            for request_id in self.disconnects.find(waiting):
                pb_utils.Logger.log_info(f"llm: HTTP client of {request_id} left; aborting")
                self._cancel(self.active[request_id])

    def _cancel(self, st: Any) -> None:
        st.cancelled = True
        if st.added:  # else once it is ("added")
            self.engine.abort(st.request_id)  # its final delta (reason "abort") closes it

    def _end_all(self, message: str) -> None:
        for st in list(self.active.values()):
            try:
                self._end(st, message)
            except Exception as e:  # one failed send must not keep the others open
                pb_utils.Logger.log_error(f"llm: response thread: {e!r}")

    def _end(self, st: Any, message: str) -> None:
        del self.active[st.request_id]  # the engine's final delta for it is then ignored
        if st.added:  # else once it is ("added")
            self.engine.abort(st.request_id)
        self.metrics.observe_request(st.timer.timing())
        st.sender.send(_error(message), flags=FINAL)

    # --- shutdown ---------------------------------------------------------------------------------

    def finalize(self) -> None:
        # Triton calls this once in-flight requests are done (or its exit timeout ran out): the
        # response thread ends any still running (an error with the final flag, the engine told
        # to abort them), then stops.
        self.queue.put(("stop", None))
        self.thread.join(timeout=10)
        self.metrics.close()
        self.engine.shutdown()


def model_instances(model_config: dict[str, Any]) -> int:
    """The model's instances over all of its instance groups (a group's count on each of its
    GPUs, where it names them)."""
    groups = model_config.get("instance_group") or [{}]
    return sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or [])) for g in groups)


def _getter(request: Any) -> Any:
    def get(name: str) -> Any:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        value = tensor.as_numpy().reshape(-1)
        return value[0] if value.size else None

    return get


def _error(message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
