"""Start Triton Inference Server on the model repository: `python -m engine.serve`.

The launcher finds `tritonserver` (on PATH, as in the NGC container, or the copy shipped in the
`nvidia-pytriton` wheel), prepares a backends folder holding the Python backend and the stub that
matches this interpreter, sets the library path the stub needs, starts the server, waits until it
is ready and prints the endpoints. Then it supervises: SIGINT/SIGTERM drain and stop the server
within a bounded time, and a dead Python-backend stub is followed by a restart. The pieces live
in `engine.serving` (install, process, supervisor, cli); the names tests and tools use are
re-exported here. This module imports nothing heavy (no torch, no transformers).
"""

from __future__ import annotations

import sys

from engine.serving.cli import main
from engine.serving.install import REPO_ROOT, STUB_NAME, TritonInstall, find_tritonserver
from engine.serving.process import Server, free_port, start_server

__all__ = [
    "REPO_ROOT",
    "STUB_NAME",
    "Server",
    "TritonInstall",
    "find_tritonserver",
    "free_port",
    "main",
    "start_server",
]

if __name__ == "__main__":
    sys.exit(main())
