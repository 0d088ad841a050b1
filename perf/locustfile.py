"""Load test: users stream completions over Triton's HTTP generate_stream endpoint.

    make loadtest USERS=8 SPAWN_RATE=2 DURATION=60s     # CSV and HTML report in perf/results/
    .venv/bin/locust -f perf/locustfile.py --host http://localhost:8000 \
        --headless -u 8 -r 2 -t 60s

The POST line (`generate_stream`) is timed by locust until the response headers arrive, which
Triton sends with the first token. Each request also reports custom events of type `SSE`, so
locust's table, CSV and HTML report show them as rows of their own:
- `TTFT`: time to the first streamed response;
- `ITL`: inter-token latency, (last response - first response) / (responses - 1), one value per
  request, as `make sweep` and genai-perf define it (they count tokens; each response is
  normally one token);
- `E2E`: the whole stream (its response length is the number of responses).
Every request asks for exactly PERF_MAX_TOKENS tokens (min_tokens and ignore_eos).

Settings (environment): PERF_MAX_TOKENS (64), PERF_PROMPT_WORDS (64), PERF_TEMPERATURE (0),
PERF_MODEL (llm).
"""

from __future__ import annotations

import json
import os
import random
import time

import gevent
from locust import HttpUser, between, events, stats, task
from locust.env import Environment

MODEL = os.environ.get("PERF_MODEL", "llm")
MAX_TOKENS = int(os.environ.get("PERF_MAX_TOKENS", "64"))
PROMPT_WORDS = int(os.environ.get("PERF_PROMPT_WORDS", "64"))
TEMPERATURE = float(os.environ.get("PERF_TEMPERATURE", "0"))
WORDS = "the a model token stream server latency batch cache prefix kernel decode".split()


@events.quitting.add_listener
def _last_csv_rows(environment: Environment, **_kwargs: object) -> None:
    # NOTE: locust rewrites its --csv files once a second and not again at exit, so streams that
    # finished during --stop-timeout would be missing from them (though in the summary and the
    # HTML report). The users have all stopped by now: one more tick writes the final figures.
    options = environment.parsed_options
    if options is not None and options.csv_prefix:
        gevent.sleep(stats.CSV_STATS_INTERVAL_SEC + 0.2)


def make_prompt(rng: random.Random) -> str:
    # Random words: requests share little prefix, so the prefix cache does not flatter results.
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


class StreamingUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def generate_stream(self) -> None:
        params = {
            "max_tokens": MAX_TOKENS,
            "min_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
        }
        body = {
            "text_input": make_prompt(self.rng),
            "stream": True,
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
        }
        start = time.perf_counter()
        first: float | None = None
        last = start
        chunks = 0
        with self.client.post(
            f"/v2/models/{MODEL}/generate_stream",
            json=body,
            stream=True,
            catch_response=True,
            name="generate_stream",
        ) as response:
            other: list[bytes] = []
            for line in response.iter_lines():
                if not line.startswith(b"data:"):
                    other.append(line)
                    continue
                event = json.loads(line[len(b"data:") :])
                if "error" in event:
                    response.failure(event["error"])
                    return
                last = time.perf_counter()
                if first is None:
                    first = last
                    self._report("TTFT", first - start, 0)
                chunks += 1
            if first is None:
                # A request refused before streaming: the body is Triton's {"error": ...}.
                body = b" ".join(other).decode(errors="replace")[:300]
                response.failure(f"no tokens streamed (HTTP {response.status_code}): {body}")
                return
            response.success()
        if chunks > 1:
            self._report("ITL", (last - first) / (chunks - 1), chunks)
        self._report("E2E", last - start, chunks)

    def _report(self, name: str, seconds: float, length: int) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=None,
            context={},
        )
