"""Where `tritonserver` is and what it needs around it (backends folder, library path, PATH)."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_NAME = "triton_python_backend_stub"
ENV_PREFIX = "LLM_"  # engine settings (engine.config.ENV_PREFIX; not imported: keep this light)


@dataclass(frozen=True)
class TritonInstall:
    """Where the server binary is and what it needs around it."""

    binary: Path
    backend_dir: Path | None  # None: the binary's own default (/opt/tritonserver/backends)
    lib_dirs: tuple[Path, ...]  # prepended to LD_LIBRARY_PATH


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
    check_stub_numpy()
    libs = dist.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary, prepare_backends(dist), (libs, *libpython_dirs()))


class StubNumpyError(RuntimeError):
    """The wheel's Python backend stub cannot run with this environment's numpy."""


def check_stub_numpy(version: str | None = None) -> None:
    """nvidia-pytriton's stub was built for numpy 1 (the wheel pins numpy<2). Under numpy 2 it
    misreads numpy's dtypes: every text input reaches the model as its first byte repeated and
    the stub dies on the first request (seen on an H200 machine whose Python had numpy 2.5).
    The stub embeds this interpreter's environment, so refuse here, before anything starts."""
    if version is None:
        try:
            version = metadata.version("numpy")
        except metadata.PackageNotFoundError:
            return
    if int(version.split(".")[0]) >= 2:
        raise StubNumpyError(
            f"this environment has numpy {version}, but the Python backend stub of "
            "nvidia-pytriton is built for numpy 1 and corrupts text inputs under numpy 2: "
            "install numpy<2 here (pip install 'numpy<2'), or run the server from an "
            "environment that has it (perf/gpu_serve.sh shows one way)"
        )


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


def libpython_dirs() -> list[Path]:
    """The folder of this interpreter's libpython, when it has one (pyenv, uv, conda builds).

    The stub links `libpython3.X.so`; without this it may load the system's copy, a different
    build, and fail on import with undefined symbols.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and any(Path(libdir).glob("libpython3*.so*")):
        return [Path(libdir)]
    return []


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA driver with a GPU is present (no CUDA import: this must stay light)."""
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


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
