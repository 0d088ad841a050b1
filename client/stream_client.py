"""Stream a completion from the Triton `llm` model and print it as it arrives.

    python client/stream_client.py --prompt "What is the capital of France?" --chat
    python client/stream_client.py --protocol http --url localhost:8000 --prompt "Once upon"

gRPC uses tritonclient's bidirectional stream; HTTP uses Triton's generate_stream endpoint
(server-sent events). The request is the vllm_backend one: text_input, stream,
sampling_parameters (JSON) and the optional apply_chat_template flag.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

MODEL = "llm"


def build_inputs(
    prompt: str, params: dict[str, Any], chat: bool = False, stream: bool = True
) -> dict[str, Any]:
    """The request fields, as plain values (one element each)."""
    return {
        "text_input": prompt,
        "stream": stream,
        "exclude_input_in_output": True,
        "apply_chat_template": chat,
        "sampling_parameters": json.dumps(params),
    }


def grpc_inputs(fields: dict[str, Any]) -> list[Any]:
    """tritonclient.grpc InferInputs for `build_inputs` fields."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in fields.items():
        if isinstance(value, bool):
            inp = grpcclient.InferInput(name, [1], "BOOL")
            inp.set_data_from_numpy(np.array([value], dtype=bool))
        else:
            inp = grpcclient.InferInput(name, [1], "BYTES")
            inp.set_data_from_numpy(np.array([str(value).encode()], dtype=np.object_))
        inputs.append(inp)
    return inputs


def stream_grpc(url: str, fields: dict[str, Any], model: str = MODEL) -> Iterator[str]:
    """Yield text deltas over gRPC until the server sends the final flag."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            model,
            grpc_inputs(fields),
            request_id=uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        while True:
            result, error = results.get()
            if error is not None:
                raise RuntimeError(str(error))
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                yield text.reshape(-1)[0].decode("utf-8")
            params = result.get_response().parameters
            if params["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def stream_http(url: str, fields: dict[str, Any], model: str = MODEL) -> Iterator[str]:
    """Yield text deltas from POST /v2/models/<model>/generate_stream (server-sent events)."""
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream",
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        response = urllib.request.urlopen(request)
    except urllib.error.HTTPError as e:  # the model's error comes back as a JSON body
        raise RuntimeError(error_message(e.read().decode("utf-8", "replace"))) from None
    with response:
        for event in iter_sse(response):
            if "error" in event:
                raise RuntimeError(event["error"])
            yield event.get("text_output", "")


def error_message(body: str) -> str:
    """The `error` field of an error body (plain JSON, or one server-sent event)."""
    text = body.strip().removeprefix("data:")
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return body.strip()


def iter_sse(lines: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent-event stream (`data: {...}` lines)."""
    for raw in lines:
        line = raw.decode("utf-8").strip() if isinstance(raw, bytes) else raw.strip()
        if line.startswith("data:"):
            yield json.loads(line[len("data:") :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="host:port (default: localhost:8001 / 8000)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    args = parser.parse_args(argv)

    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    fields = build_inputs(args.prompt, params, chat=args.chat)
    stream = stream_grpc if args.protocol == "grpc" else stream_http
    try:
        for delta in stream(url, fields, args.model):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except (RuntimeError, OSError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
