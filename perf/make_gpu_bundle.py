"""Build `.gpubundle/`: what the GPU device machine lacks to run `tritonserver` and a gRPC client.

    .venv/bin/python perf/make_gpu_bundle.py [--out .gpubundle] [--stub-python 3.12]

The device has Python 3.12, torch and transformers, but no tritonserver, no tritonclient and no
package registry; at most 64 MiB of working tree travels. This writes:

- `tritonserver.tar.xz`: a trimmed copy of the nvidia-pytriton wheel's server, laid out as the
  wheel lays it out, so that `engine.serving.install.find_tritonserver()` finds it through
  `import pytriton` once the unpacked folder is on PYTHONPATH (no change to the engine):
      pytriton/__init__.py                         (empty: only the folder's location matters)
      pytriton/tritonserver/bin/tritonserver
      pytriton/tritonserver/backends/python/{libtriton_python.so,triton_python_backend_utils.py}
      pytriton/tritonserver/python_backend_stubs/<X.Y>/triton_python_backend_stub
      nvidia_pytriton.libs/<only the libraries those load, transitively (ELF NEEDED entries)>
- `whl/`: wheels for CPython 3.12 manylinux x86_64 of tritonclient (the version in pyproject)
  with what its gRPC client needs, for `pip install --no-index --no-deps --target /tmp/site`.

It prints what it took and the bundle's size. The libraries are found by reading the NEEDED
entries (readelf -d) of the binary, the backend and the stub, then of each library they name that
the wheel carries; the system's own (libc, libstdc++, libz, libpython) are left to the machine.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What tritonclient's gRPC client needs (its wheel's Requires-Dist: the base list plus the grpc
# extra), taken at the versions installed in this venv, where they are known to work together.
# numpy is present on the device.
CLIENT_DEPS = ("grpcio", "protobuf", "python-rapidjson", "urllib3", "packaging", "ml-dtypes")
# For the server's own environment only (`server-whl/`, see perf/gpu_serve.sh): the Python backend
# stub needs numpy 1 (nvidia-pytriton pins numpy<2), the device has numpy 2.
SERVER_DEPS = ("numpy",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


def needed(path: Path) -> list[str]:
    """The NEEDED entries of an ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def library_closure(roots: list[Path], libs_dir: Path) -> list[Path]:
    """The wheel's libraries that `roots` load, directly or through each other."""
    carried = {p.name: p for p in libs_dir.iterdir()}
    seen: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        for name in needed(todo.pop()):
            if name in carried and name not in seen:
                seen[name] = carried[name]
                todo.append(carried[name])
    return sorted(seen.values())


def tritonclient_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r"tritonclient(?:\[[^\]]*\])?==([0-9.]+)", text)
    if not m:
        raise SystemExit("no tritonclient==VERSION pin in pyproject.toml")
    return m.group(1)


def download_wheels(dest: Path, pins: dict[str, str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp"]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        cmd += ["-d", str(dest), f"{name}=={version}"]
        subprocess.run(cmd, check=True)


def build_server_tar(out: Path, stub_versions: list[str]) -> list[str]:
    import pytriton  # the wheel in this venv

    dist = Path(pytriton.__file__).parent / "tritonserver"
    libs_dir = dist.parent.parent / "nvidia_pytriton.libs"
    binary = dist / "bin" / "tritonserver"
    backend = dist / "backends" / "python"
    stubs = [
        dist / "python_backend_stubs" / v / "triton_python_backend_stub" for v in stub_versions
    ]
    for stub in stubs:
        if not stub.is_file():
            raise SystemExit(f"no stub at {stub}")
    libs = library_closure([binary, backend / "libtriton_python.so", *stubs], libs_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pkg = root / "pytriton"
        (pkg / "tritonserver" / "bin").mkdir(parents=True)
        (pkg / "__init__.py").write_text('"""Trimmed tritonserver from nvidia-pytriton."""\n')
        shutil.copy2(binary, pkg / "tritonserver" / "bin" / "tritonserver")
        (pkg / "tritonserver" / "backends" / "python").mkdir(parents=True)
        for name in BACKEND_FILES:
            shutil.copy2(backend / name, pkg / "tritonserver" / "backends" / "python" / name)
        for version, stub in zip(stub_versions, stubs, strict=True):
            dst = pkg / "tritonserver" / "python_backend_stubs" / version
            dst.mkdir(parents=True)
            shutil.copy2(stub, dst / stub.name)
        (root / "nvidia_pytriton.libs").mkdir()
        for lib in libs:
            shutil.copy2(lib, root / "nvidia_pytriton.libs" / lib.name)
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for item in ("pytriton", "nvidia_pytriton.libs"):
                tar.add(root / item, arcname=item)
        raw = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    print(f"server: {len(libs)} libraries, {raw / 2**20:.1f} MiB unpacked")
    return [lib.name for lib in libs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".gpubundle")
    ap.add_argument("--stub-python", action="append", default=None, help="default: 3.12")
    ap.add_argument("--no-wheels", action="store_true", help="only the server")
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    libs = build_server_tar(out / "tritonserver.tar.xz", args.stub_python or ["3.12"])
    print("libraries:", " ".join(libs))
    if not args.no_wheels:
        shutil.rmtree(out / "whl", ignore_errors=True)
        pins = {"tritonclient": tritonclient_version()}
        pins.update({name: metadata.version(name) for name in CLIENT_DEPS})
        download_wheels(out / "whl", pins)
        shutil.rmtree(out / "server-whl", ignore_errors=True)
        download_wheels(out / "server-whl", {name: metadata.version(name) for name in SERVER_DEPS})
        for whl in sorted(out.glob("*whl/*.whl")):
            print(f"wheel: {whl.parent.name}/{whl.name} ({whl.stat().st_size / 2**20:.1f} MiB)")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle: {out} {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
