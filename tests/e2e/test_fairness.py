"""One long prompt must not starve short requests (issue 15): through the real server, 100
short requests beside one 6,000-token request finish within 3x their time alone. CPU, the
default model; minutes long, so it runs in `make soak`."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from client.stream_client import build_inputs, grpc_inputs

from .conftest import MODEL_DIR
from .launcher import start_launcher
from .test_reliability import assert_healthy

pytestmark = pytest.mark.soak

ENGINE = {"max_running_requests": 128, "max_total_tokens": 16384}
SHORT = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}


class Finishes:
    """Final responses of the requests sent on one gRPC stream, by request id."""

    def __init__(self, url: str) -> None:
        self.t0 = time.perf_counter()
        self.at: dict[str, float] = {}
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_result)

    def send(self, rid: str, prompt: str, params: dict[str, Any]) -> None:
        fields = build_inputs(prompt, params)
        self.client.async_stream_infer(
            "llm", grpc_inputs(fields), request_id=rid, enable_empty_final_response=True
        )

    def _on_result(self, result: Any, error: Any) -> None:
        with self.changed:
            if error is not None:
                self.errors.append(str(error))
            else:
                response = result.get_response()
                if response.parameters["triton_final_response"].bool_param:
                    self.at[response.id] = time.perf_counter() - self.t0
            self.changed.notify_all()

    def wait(self, rids: set[str], timeout: float) -> float:
        """Seconds from the first send until every request in `rids` finished."""
        with self.changed:
            done = self.changed.wait_for(lambda: rids <= set(self.at) or self.errors, timeout)
        assert done and not self.errors, (self.errors, rids - set(self.at))
        return max(self.at[r] for r in rids)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _shorts(rng: random.Random, words: list[str]) -> list[str]:
    """Fresh prompts each run (no prefix-cache hits between runs), 8 to 20 words."""
    return [" ".join(rng.choices(words, k=rng.randrange(8, 20))) for _ in range(100)]


def test_short_requests_beside_a_long_prompt(tmp_path: Path) -> None:
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:5000]
    long_ids = tokenizer(" ".join(rng.choices(words, k=6000))).input_ids[:6000]
    long_prompt = tokenizer.decode(long_ids)
    assert 5800 <= len(tokenizer(long_prompt).input_ids) <= 6200
    launcher = start_launcher(tmp_path / "serve.log", engine=ENGINE)
    try:
        launcher.wait_ready()
        alone = Finishes(launcher.server.grpc_url)
        shorts = {f"s{i}": p for i, p in enumerate(_shorts(rng, words))}
        for rid, prompt in shorts.items():
            alone.send(rid, prompt, SHORT)
        alone_s = alone.wait(set(shorts), timeout=600)
        alone.close()

        beside = Finishes(launcher.server.grpc_url)
        beside.send("long", long_prompt, LONG)
        shorts = {f"t{i}": p for i, p in enumerate(_shorts(rng, words))}
        for rid, prompt in shorts.items():
            beside.send(rid, prompt, SHORT)
        beside_s = beside.wait(set(shorts), timeout=1800)
        long_s = beside.wait({"long"}, timeout=1800)
        beside.close()
        print(
            f"100 short requests: {alone_s:.1f} s alone, {beside_s:.1f} s beside a "
            f"6,000-token request (which took {long_s:.1f} s)"
        )
        assert beside_s <= 3.0 * alone_s, (alone_s, beside_s)
        assert_healthy(launcher.server)
    finally:
        launcher.stop()
