"""Start Triton Inference Server on the model repository: `python -m engine.serve`.

The launcher finds `tritonserver` (on PATH, as in the NGC container, or the copy shipped in the
`nvidia-pytriton` wheel), prepares a backends folder holding the Python backend and the stub that
matches this interpreter, sets the library path the stub needs, starts the server, waits until it
is ready, prints the endpoints, and forwards SIGINT/SIGTERM to it.

It also holds `engine_config_dict`, which the Triton model calls to turn model.json plus the
`LLM_<FIELD>` environment variables into EngineConfig values. This module imports nothing heavy:
the Triton model and the end-to-end tests import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "LLM_"
REPO_ROOT = Path(__file__).resolve().parent.parent
STUB_NAME = "triton_python_backend_stub"


# --- engine settings: model.json + LLM_<FIELD> environment overrides ---------------------------


def engine_config_dict(
    model_json: Path, repo_root: Path, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """EngineConfig values from model.json, overridden by `LLM_<FIELD>` environment variables.

    `LLM_MAX_TOTAL_TOKENS=4096` sets `max_total_tokens`; values are parsed by the field's type
    (`none` or an empty string clears an optional field). A relative `model` path is resolved
    against `repo_root` (the folder holding the model repository). Unknown keys in model.json are
    left in for `EngineConfig.from_dict` to reject by name.
    """
    from engine.config import EngineConfig

    environ = os.environ if environ is None else environ
    values: dict[str, Any] = json.loads(model_json.read_text()) if model_json.is_file() else {}
    if not isinstance(values, dict):
        raise ValueError(f"{model_json} must hold a JSON object of EngineConfig fields")
    for f in dataclasses.fields(EngineConfig):
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = _parse_env_value(f.name, str(f.type), raw)
    model = values.get("model", EngineConfig.model)
    if model and not Path(model).is_absolute():
        values["model"] = str((repo_root / model).resolve())
    return values


def _parse_env_value(name: str, type_name: str, raw: str) -> Any:
    text = raw.strip()
    if "None" in type_name and text.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
    except ValueError:
        var = ENV_PREFIX + name.upper()
        raise ValueError(f"{var}={raw!r}: expected a value of type {type_name}") from None
    return raw


# --- finding and preparing the server ------------------------------------------------------------


@dataclass(frozen=True)
class TritonInstall:
    """Where the server binary is and what it needs around it."""

    binary: Path
    backend_dir: Path | None  # None: the binary's own default (/opt/tritonserver/backends)
    lib_dirs: tuple[Path, ...]  # prepended to LD_LIBRARY_PATH

    @property
    def from_wheel(self) -> bool:
        return self.backend_dir is not None


def find_tritonserver() -> TritonInstall | None:
    """The `tritonserver` on PATH, else the one in the nvidia-pytriton wheel; None if neither."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, ())
    try:
        import pytriton
    except ImportError:
        return None
    dist = Path(pytriton.__file__).parent / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    libs = dist.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary, prepare_backends(dist), (libs, *_libpython_dirs()))


def prepare_backends(dist: Path, dest: Path | None = None) -> Path:
    """A backends folder with the wheel's Python backend plus the stub for this Python version.

    The wheel keeps one stub per Python version apart from the backend; the backend looks for it
    next to `libtriton_python.so`. Files are copied only when missing or changed.
    """
    dest = dest or Path(sys.prefix) / "share" / "llm-serve" / "backends"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise FileNotFoundError(
            f"nvidia-pytriton ships no Python backend stub for Python {version}"
        )
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = [stub, *sorted((dist / "backends" / "python").glob("*.*"))]
    for src in sources:
        if src.suffix not in ("", ".so", ".py"):
            continue
        dst = python_dir / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return dest


def _libpython_dirs() -> list[Path]:
    """The folder of this interpreter's libpython, when it has one (pyenv, uv, conda builds).

    The stub links `libpython3.X.so`; without this it may load the system's copy, a different
    build, and fail on import with undefined symbols.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and any(Path(libdir).glob("libpython3*.so*")):
        return [Path(libdir)]
    return []


def server_env(install: TritonInstall, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the server: this venv's bin first on PATH and the library folders.

    The stub embeds the first `python3` on PATH's environment, so the venv's packages (torch,
    transformers, this project) are the ones the Triton model imports.
    """
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if install.lib_dirs:
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, install.lib_dirs), old]).rstrip(":")
    model = env.get(ENV_PREFIX + "MODEL")
    if model and not Path(model).is_absolute() and Path(model).exists():
        env[ENV_PREFIX + "MODEL"] = str(Path(model).resolve())  # relative to where we were started
    return env


# --- running it ----------------------------------------------------------------------------------


@dataclass
class Server:
    """A running tritonserver process and its endpoints."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str = "localhost"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        url = f"http://{self.http_url}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ready; raise if it exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"tritonserver exited with code {code} before it was ready")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; also kill Python backend stubs left behind."""
        stubs = _child_stubs(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _kill_stubs(stubs)
        return self.process.returncode


def start_server(
    model_repository: Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    extra_args: Sequence[str] = (),
    install: TritonInstall | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    new_session: bool = False,
) -> Server:
    """Start tritonserver (does not wait for readiness; call `Server.wait_ready`)."""
    install = install or find_tritonserver()
    if install is None:
        raise FileNotFoundError(
            "tritonserver not found: not on PATH and the nvidia-pytriton package is not installed"
        )
    cmd = [
        str(install.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    cmd.extend(extra_args)
    process = subprocess.Popen(
        cmd,
        env=server_env(install, env),
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=new_session,
    )
    return Server(process, http_port, grpc_port, metrics_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_stubs(pid: int) -> list[int]:
    """Pids of the Python backend stubs whose parent is `pid` (read from /proc)."""
    stubs = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and STUB_NAME.encode() in cmdline:
            stubs.append(int(entry.name))
    return stubs


def _kill_stubs(pids: Sequence[int]) -> None:
    # NOTE: a stub whose server crashed can linger and ignore SIGTERM; only SIGKILL ends it.
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _default_repository() -> Path:
    here = Path("model_repository")
    return here if here.is_dir() else REPO_ROOT / "model_repository"


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
    stubs = _child_stubs(server.process.pid)
    code = server.process.wait()
    _kill_stubs(stubs)
    return code


def _check(install: TritonInstall, repository: Path) -> int:
    """Print the pieces the server needs; non-zero when one is missing."""
    ok = (repository / "llm" / "config.pbtxt").is_file()
    print(
        f"model repository: {repository.resolve()} ({'ok' if ok else 'missing llm/config.pbtxt'})"
    )
    if install.backend_dir is not None:
        stub = install.backend_dir / "python" / STUB_NAME
        print(f"backends: {install.backend_dir} (stub {'ok' if stub.is_file() else 'missing'})")
        libpython = ", ".join(map(str, _libpython_dirs())) or "the system's"
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


if __name__ == "__main__":
    sys.exit(main())
