"""One lock per process for the GPU work of every engine in it.

While a CUDA graph is being captured, the default CUDA generator is in capture mode for the whole
process: a draw from it on another thread fails ("Offset increment outside graph capture"), and
in CUDA's global capture mode any unsafe call from another thread invalidates the capture. A
process can hold several engines (tests do; so does `AsyncEngine` beside an offline `LLM`), each
with its own loop thread. Every model runner therefore holds this lock while it builds its model
and captures its graphs, and while it runs a step (forward and sampling). One engine per process,
the server's case, never waits on it.
"""

from __future__ import annotations

import threading

DEVICE_LOCK = threading.RLock()
