"""Load test: users stream completions over Triton's HTTP generate_stream endpoint.

    .venv/bin/locust -f perf/locustfile.py --host http://localhost:8000 \
        --headless -u 8 -r 2 -t 60s

The POST line (`generate_stream`) is timed by locust until the response headers arrive, which
Triton sends with the first token. Each request also reports two custom events of type `SSE`:
`time_to_first_token` and `stream_complete` (the whole stream; its response length is the number
of chunks), so locust's table and CSV show TTFT and end-to-end percentiles side by side.

Settings (environment): PERF_MAX_TOKENS (64), PERF_PROMPT_WORDS (64), PERF_TEMPERATURE (0),
PERF_MODEL (llm).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("PERF_MODEL", "llm")
MAX_TOKENS = int(os.environ.get("PERF_MAX_TOKENS", "64"))
PROMPT_WORDS = int(os.environ.get("PERF_PROMPT_WORDS", "64"))
TEMPERATURE = float(os.environ.get("PERF_TEMPERATURE", "0"))
WORDS = "the a model token stream server latency batch cache prefix kernel decode".split()


def make_prompt(rng: random.Random) -> str:
    # Random words: requests share little prefix, so the prefix cache does not flatter results.
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


class StreamingUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def generate_stream(self) -> None:
        params = {"max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "ignore_eos": True}
        body = {
            "text_input": make_prompt(self.rng),
            "stream": True,
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
        }
        start = time.perf_counter()
        first: float | None = None
        chunks = 0
        with self.client.post(
            f"/v2/models/{MODEL}/generate_stream",
            json=body,
            stream=True,
            catch_response=True,
            name="generate_stream",
        ) as response:
            for line in response.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    response.failure(event["error"])
                    return
                if first is None:
                    first = time.perf_counter()
                    self._report("time_to_first_token", first - start, 0)
                chunks += 1
            if chunks == 0:
                response.failure(f"no tokens streamed (HTTP {response.status_code})")
                return
            response.success()
        self._report("stream_complete", time.perf_counter() - start, chunks)

    def _report(self, name: str, seconds: float, length: int) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=None,
            context={},
        )
