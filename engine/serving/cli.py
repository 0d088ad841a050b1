"""The command line of `python -m engine.serve`."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.serving.install import (
    REPO_ROOT,
    STUB_NAME,
    TritonInstall,
    find_tritonserver,
    libpython_dirs,
)
from engine.serving.process import Server, child_stubs, kill_stubs, start_server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.serve",
        description="Serve the model repository with Triton Inference Server. "
        "Arguments after `--` go to tritonserver unchanged.",
    )
    parser.add_argument("--model-repository", type=Path, default=_default_repository())
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for the model to load"
    )
    parser.add_argument(
        "--check", action="store_true", help="report what would be started, then exit"
    )
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    install = find_tritonserver()
    if install is None:
        print(
            "error: tritonserver not found (install: pip install nvidia-pytriton)", file=sys.stderr
        )
        return 2
    print(f"tritonserver: {install.binary}", flush=True)
    if args.check:
        return _check(install, args.model_repository)
    server = start_server(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        extra,
        install=install,
        new_session=True,  # the terminal's Ctrl-C reaches us; we forward it exactly once
    )
    signals_seen = 0

    def forward(signum: int, _frame: object) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if server.process.poll() is None:
            # A second signal means "now": do not wait for in-flight requests.
            server.process.send_signal(signum if signals_seen == 1 else signal.SIGKILL)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        server.wait_ready(args.ready_timeout)
    except (RuntimeError, TimeoutError) as e:
        if signals_seen == 0:
            print(f"error: {e}", file=sys.stderr)
        server.stop(timeout=10)
        return 1
    _print_endpoints(server)
    stubs = child_stubs(server.process.pid)
    code = server.process.wait()
    kill_stubs(stubs)
    return code


def _default_repository() -> Path:
    here = Path("model_repository")
    return here if here.is_dir() else REPO_ROOT / "model_repository"


def _check(install: TritonInstall, repository: Path) -> int:
    """Print the pieces the server needs; non-zero when one is missing."""
    ok = (repository / "llm" / "config.pbtxt").is_file()
    print(
        f"model repository: {repository.resolve()} ({'ok' if ok else 'missing llm/config.pbtxt'})"
    )
    if install.backend_dir is not None:
        stub = install.backend_dir / "python" / STUB_NAME
        print(f"backends: {install.backend_dir} (stub {'ok' if stub.is_file() else 'missing'})")
        libpython = ", ".join(map(str, libpython_dirs())) or "the system's"
        print(f"libpython folder: {libpython}")
        ok = ok and stub.is_file()
    return 0 if ok else 1


def _print_endpoints(server: Server) -> None:
    print(
        "\n".join(
            [
                "",
                "Triton is ready (model: llm)",
                f"  HTTP     http://{server.http_url}   (POST /v2/models/llm/generate_stream)",
                f"  gRPC     {server.grpc_url}",
                f"  metrics  {server.metrics_url}",
                "Try:",
                f"  {_python()} client/stream_client.py --url {server.grpc_url} --chat"
                ' --prompt "What is the capital of France?"',
                "Stop with Ctrl-C.",
                "",
            ]
        ),
        flush=True,
    )


def _python() -> str:
    """This interpreter, relative to the working folder when it lies below it (.venv/bin/python)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)
