"""The command line of `python -m engine.serve`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from engine.serving.install import (
    REPO_ROOT,
    STUB_NAME,
    StubNumpyError,
    TritonInstall,
    find_tritonserver,
    has_nvidia_gpu,
    libpython_dirs,
)
from engine.serving.lifecycle import GRACE_ENV, grace_from_env, parse_grace
from engine.serving.process import Server, start_server
from engine.serving.supervisor import KILL_MARGIN_S, MODEL, Supervisor

# Lines tritonserver prints on a machine without a GPU that mean nothing there (no flag hides
# them; CPU_FLAGS in process.py avoid the others).
CPU_NOISE = (b"CudaDriverHelper has not been initialized", b"CUDA memory pool disabled")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.serve",
        description="Serve the model repository with Triton Inference Server. "
        "Arguments after `--` go to tritonserver unchanged.",
    )
    parser.add_argument("--model-repository", type=Path, default=_default_repository())
    parser.add_argument("--http-port", type=_port, default=8000)
    parser.add_argument("--grpc-port", type=_port, default=8001)
    parser.add_argument("--metrics-port", type=_port, default=8002)
    parser.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for the model to load"
    )
    parser.add_argument(
        "--shutdown-grace",
        type=_grace,
        default=None,
        help="on SIGTERM/Ctrl-C, seconds in-flight requests may still run before they are ended "
        f"with a 'server shutting down' error (default: ${GRACE_ENV} or 10)",
    )
    parser.add_argument(
        "--check", action="store_true", help="report what would be started, then exit"
    )
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    if len(set(ports)) < len(ports):
        parser.error(f"--http-port, --grpc-port and --metrics-port must differ: {ports}")
    if args.shutdown_grace is None:  # the flag overrides the variable, so check it only here
        try:
            args.shutdown_grace = grace_from_env()
        except ValueError as e:
            parser.error(str(e))

    try:
        install = find_tritonserver()
    except StubNumpyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if install is None:
        print(
            "error: tritonserver not found (install: pip install nvidia-pytriton)", file=sys.stderr
        )
        return 2
    print(f"tritonserver: {install.binary}", flush=True)
    if args.check:
        return _check(install, args.model_repository)
    if not _has_model(args.model_repository):
        print(f"error: {args.model_repository}: no {MODEL}/config.pbtxt", file=sys.stderr)
        return 2
    if not any(a.startswith("--exit-timeout-secs") for a in extra):
        # Above the launcher's own limit, so Triton's exit-timeout path (which crashes and hangs
        # in 2.51 with streams in flight) is never taken; the launcher kills first.
        extra.append(f"--exit-timeout-secs={int(args.shutdown_grace + KILL_MARGIN_S + 5)}")
    env = dict(os.environ)
    env[GRACE_ENV] = str(args.shutdown_grace)
    relay = not has_nvidia_gpu()  # filter the CPU-only noise out of the server's output

    def start() -> Server:
        server = start_server(
            args.model_repository,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            extra,
            install=install,
            env=env,
            stdout=subprocess.PIPE if relay else None,
            new_session=True,  # the terminal's Ctrl-C reaches only us; we drain, then stop it
            port_wait_s=10.0 if started else 0.0,  # a restart: the old server's ports free up
        )
        started.append(server)
        if relay and server.process.stdout is not None:
            threading.Thread(target=_relay, args=(server.process.stdout,), daemon=True).start()
        return server

    started: list[Server] = []
    supervisor = Supervisor(
        start, args.shutdown_grace, args.ready_timeout, on_ready=_print_endpoints, log=_log
    )
    try:
        return supervisor.run()
    except OSError as e:  # a port in use
        print(f"error: {e}", file=sys.stderr)
        return 1


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: a TCP port is 1-65535")
    return port


def _grace(text: str) -> float:
    try:
        return parse_grace(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None


def _relay(lines: IO[bytes]) -> None:
    """Copy the server's output to ours, less CPU_NOISE, until it ends. Keeps reading when our
    stdout is gone (`| head`): a full pipe would block the server's logging."""
    out: IO[bytes] | None = sys.stdout.buffer
    with lines:  # closed at the server's end: a restarted server's old pipe is not kept open
        for line in lines:
            if out is None or any(noise in line for noise in CPU_NOISE):
                continue
            try:
                out.write(line)
                out.flush()
            except OSError:
                out = None


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _default_repository() -> Path:
    here = Path("model_repository")
    return here if here.is_dir() else REPO_ROOT / "model_repository"


def _has_model(repository: Path) -> bool:
    return (repository / MODEL / "config.pbtxt").is_file()


def _check(install: TritonInstall, repository: Path) -> int:
    """Print the pieces the server needs; non-zero when one is missing."""
    ok = _has_model(repository)
    state = "ok" if ok else f"missing {MODEL}/config.pbtxt"
    print(f"model repository: {repository.resolve()} ({state})")
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
                f"Triton is ready (model: {MODEL})",
                f"  HTTP     http://{server.http_url}   (POST /v2/models/{MODEL}/generate_stream)",
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
