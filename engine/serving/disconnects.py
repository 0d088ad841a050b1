"""HTTP clients that went away before Triton noticed: the non-streaming `/generate` case.

Triton 2.51's HTTP frontend cancels a request when its connection closes, but it holds the
connection paused (not reading) until it starts the reply, which for `/generate` is the one final
response. A client that hangs up on a long non-streaming request (or on a stream before its first
token) is therefore never seen to leave: `is_cancelled()` stays false and the request would run
to `max_tokens`. The server's socket of such a request sits in CLOSE_WAIT (the client's FIN
arrived, unread). The kernel's sock_diag netlink interface (what `ss` uses) lists those sockets
with the time each last received data, which is when its request arrived. A request that has sent
nothing yet and arrived just after such a time, with no other candidate near it, is the one whose
client left. An ambiguous match aborts nothing (the server's `max_tokens_cap` still bounds it).
A socket counts only once it has been seen in two dumps in a row: an idle keep-alive connection
that its client closes is in CLOSE_WAIT too, for the moment Triton takes to close it.

A stub sees every CLOSE_WAIT socket on the server's port but only its own requests, so where
several instances of the model serve (instance_group), a socket of another instance's request
could be matched to one of this instance's: the search is then off (`of_parent`). Another
model served over the same HTTP port would share the risk.

Linux only; anywhere else (or without netlink) nothing is found and nothing is aborted.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
TCP_CLOSE_WAIT = 8
TCPI_LAST_DATA_RECV = 52  # byte offset of tcpi_last_data_recv (ms) in struct tcp_info
DIAG_MSG_LEN = 72  # struct inet_diag_msg; its last field is the socket's inode

# A request's arrival in the model follows the socket's last data by the frontend's and the
# stub's hand-over: milliseconds, more under load. The slack covers the kernel's ms clock.
MATCH_WINDOW_S = 1.0
CLOCK_SLACK_S = 0.02
DEFAULT_HTTP_PORT = 8000


def server_http_port(pid: int) -> int | None:
    """The HTTP port of the tritonserver `pid` from its command line; None when HTTP is off."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    port: int | None = DEFAULT_HTTP_PORT
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if name == "--http-port":
            port = int(value)
        elif name == "--allow-http" and value.lower() in ("false", "0", "no", "off"):
            return None
    return port


def close_wait_times(port: int) -> dict[int, float]:
    """Socket inode -> the monotonic time at which that CLOSE_WAIT connection to local `port`
    last received data."""
    now = time.monotonic()
    times: dict[int, float] = {}
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
            for family in (socket.AF_INET, socket.AF_INET6):
                for inode, ms in _dump_close_wait(sock, family, port):
                    times[inode] = now - ms / 1000
    except OSError:
        return {}
    return times


def match_disconnected(
    candidates: Mapping[str, float], received: Sequence[float], window_s: float = MATCH_WINDOW_S
) -> list[str]:
    """Ids of the candidates (id -> arrival time) whose connection is one of `received`: each
    time matches the one candidate that arrived within [t - slack, t + window_s], if only one."""
    found = []
    for t in received:
        lo, hi = t - CLOCK_SLACK_S, t + window_s
        near = [rid for rid, arrival in candidates.items() if lo <= arrival <= hi]
        if len(near) == 1 and near[0] not in found:
            found.append(near[0])
    return found


class HttpDisconnects:
    """Finds the requests, among those that have not replied yet, whose HTTP client left."""

    def __init__(self, port: int | None) -> None:
        self.port = port
        self._seen: set[int] = set()  # CLOSE_WAIT sockets of the previous dump

    @classmethod
    def of_parent(cls, instances: int = 1) -> HttpDisconnects:
        """For a model running in a stub: the port of the server that started it; off (no
        port) where the model has several `instances`, whose requests this stub cannot see."""
        return cls(server_http_port(os.getppid()) if instances == 1 else None)

    def find(self, candidates: Mapping[str, float]) -> list[str]:
        """Call every fraction of a second while there are candidates (id -> arrival time)."""
        if self.port is None or not candidates:
            self._seen = set()
            return []
        current = close_wait_times(self.port)
        lasting = [t for inode, t in current.items() if inode in self._seen]
        self._seen = set(current)
        return match_disconnected(candidates, lasting)


def _dump_close_wait(sock: socket.socket, family: int, port: int) -> list[tuple[int, int]]:
    """(inode, tcpi_last_data_recv in ms ago) of each CLOSE_WAIT TCP socket of `family` on local
    `port`."""
    # struct inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed socket id.
    req = struct.pack(
        "=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 1 << TCP_CLOSE_WAIT
    )
    req += bytes(48)
    flags = NLM_F_REQUEST | NLM_F_DUMP
    header = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, flags, 1, 0)
    sock.sendto(header + req, (0, 0))
    found: list[tuple[int, int]] = []
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, offset)
            if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
                return found
            msg = data[offset + 16 : offset + length]
            if struct.unpack_from("!H", msg, 4)[0] == port:  # id.sport, network byte order
                age = _last_data_recv(msg)
                if age is not None:
                    found.append((struct.unpack_from("=I", msg, DIAG_MSG_LEN - 4)[0], age))
            offset += (length + 3) & ~3


def _last_data_recv(msg: bytes) -> int | None:
    attr = DIAG_MSG_LEN
    while attr + 4 <= len(msg):
        length, kind = struct.unpack_from("=HH", msg, attr)
        if length < 4:
            break
        if kind == INET_DIAG_INFO and length >= 4 + TCPI_LAST_DATA_RECV + 4:
            return int(struct.unpack_from("=I", msg, attr + 4 + TCPI_LAST_DATA_RECV)[0])
        attr += (length + 3) & ~3
    return None
