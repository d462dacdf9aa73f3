"""Listening sockets, bound before anything says it serves.

Binding first turns a port in use (or an address the host does not have) into one clear
error line before any banner, instead of a traceback from deep inside the event loop after
the banner said "serving on ...". Several router workers each get their own socket on the
same port with ``SO_REUSEPORT``, so the kernel spreads connections over them; a probe
without it first makes sure no other process holds the port, since a second router with
``SO_REUSEPORT`` would otherwise quietly share it.

Port 0 asks the OS for a free port at bind time (nothing can take it between choosing and
binding); the first socket's port is the one every other worker binds, and the caller
reads it back from the sockets to say where it serves.
"""

from __future__ import annotations

import contextlib
import socket

from smetric.core.errors import UserError


def listen(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """``count`` listening sockets on ``host:port`` (0: one the OS picks, shared by all);
    ``UserError``, said plainly, if it is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sockets: list[socket.socket] = []
    try:
        if port != 0:
            _bind(family, address, reuse_port=False).close()  # nobody else holds it
        sockets.append(_bind(family, address, reuse_port=count > 1))
        address = (address[0], bound_port(sockets[0]), *address[2:])
        sockets.extend(_bind(family, address, reuse_port=True) for _ in range(count - 1))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        reason = "the port is already in use" if exc.errno == 98 else exc.strerror
        raise UserError(f"cannot listen on {host}:{port}: {reason}") from None
    return sockets


def _bind(family: int, address: tuple, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    sock.setblocking(False)
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port ``sock`` listens on: the one the OS picked for port 0."""
    return int(sock.getsockname()[1])
