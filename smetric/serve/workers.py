"""``smetric serve --workers N``: N router processes on one port, deciding alike.

One Python process decides on one core; agent bodies are large enough that the router
needs them all. Each worker is a forked copy of the configured router listening on the same
port with ``SO_REUSEPORT``, so the kernel spreads connections over them, and each stays a
stateless replica (docs/concepts/architecture.md): what they must agree on is load and the
KV view, not sessions.

- **Load.** Every engine's in-flight requests and unprefilled tokens live in an anonymous
  shared mapping made before the fork, one row per worker (``Engine.share_load``): a
  worker writes only its row, and the load it routes on is the sum over rows, so all
  workers see every request.
- **KV view.** With KV events each worker subscribes to the engines itself. The router's
  own index learns only what its worker routed, so every worker sends the blocks it
  records to its peers over Unix datagram sockets (``PeerViews``) and inserts theirs: a
  follow-up finds its prefix whichever worker the previous turn went through. Delivery is
  best effort: a dropped message only makes the view approximate, as it always is. The
  record of served prompts that stands for a full global tier (``--global-tier full``)
  travels the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web

from smetric.core.errors import ConfigError
from smetric.serve import collector
from smetric.serve.app import Router
from smetric.serve.engines import LOAD_COLUMNS, Engine
from smetric.serve.global_tier import ServedPrompts
from smetric.serve.http_errors import run_app
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.metrics import forget_process

log = logging.getLogger("smetric.serve")

# A datagram carries at most this many blocks (the leading ones: still a valid prefix).
_MAX_BLOCKS = 1 << 16
# The header that addresses the global tier's record instead of an engine's index.
_GLOBAL_TIER = 0xFFFF
_BUFFER_BYTES = 8 << 20


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (it roughly halves the HTTP overhead), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def check_workers(subscribers: Mapping[str, KVEventSubscriber], workers: int) -> None:
    """Refuse what several workers cannot share: an engine's KV-event endpoint that the
    router binds (each worker subscribes on its own)."""
    if workers > 1 and any(s.bind for s in subscribers.values()):
        raise ConfigError(
            "with several workers, KV-event subscribers cannot bind the engines' endpoints: "
            "let the engines bind (tcp://*:port) and give 'bind: false'"
        )


def serve_router(router: Router, sockets: list[socket.socket]) -> None:
    """Serve ``router`` on the listening ``sockets`` (``serve.listen``), one worker process
    each, until SIGINT or SIGTERM."""
    if len(sockets) == 1:
        _run(router.app(), sockets[0], router.settings.drain_timeout_s)
    else:
        _fork_workers(router, sockets)


def _run(app: web.Application, sock: socket.socket, drain_s: float) -> None:
    """Serve until SIGINT or SIGTERM, then drain: the socket closes at once (no new
    connections), the requests in flight get ``drain_s`` to finish before they are cut,
    and the engines' checks and subscriptions stop last."""
    collector.settle()
    # A client that goes away cancels its handler, so its request stops counting at once.
    run_app(
        app,
        sock,
        shutdown_timeout=drain_s,
        loop_factory=new_event_loop,
        access_log=None,
        handler_cancellation=True,
    )


class PeerViews:
    """Each worker's datagram socket; what one worker's engines remember, the others insert."""

    def __init__(self, workers: int) -> None:
        tag = f"smetric-{os.getpid()}-{time.monotonic_ns()}"
        self.addresses = [f"\0{tag}-{w}" for w in range(workers)]
        self.sockets = []
        for address in self.addresses:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
            sock.setblocking(False)
            sock.bind(address)
            self.sockets.append(sock)

    def join(
        self, engines: list[Engine], worker: int, served: ServedPrompts | None = None
    ) -> Callable[[web.Application], AsyncIterator[None]]:
        """Wire ``engines`` (and the record of ``served`` prompts) to the peers as worker
        ``worker``; returns the app's cleanup context that reads the peers' messages while
        the app runs."""
        if len(engines) >= _GLOBAL_TIER:
            raise ConfigError(f"at most {_GLOBAL_TIER - 1} engines with several workers")
        own = self.sockets[worker]
        peers = [a for w, a in enumerate(self.addresses) if w != worker]
        for number, engine in enumerate(engines):
            engine.on_remember = self._sender(own, peers, number)
        if served is not None:
            served.on_record = self._sender(own, peers, _GLOBAL_TIER)

        async def receive(app: web.Application) -> AsyncIterator[None]:
            loop = asyncio.get_running_loop()
            loop.add_reader(own.fileno(), self._receive, own, engines, served)
            yield
            loop.remove_reader(own.fileno())

        return receive

    @staticmethod
    def _sender(own: socket.socket, peers: list[str], number: int) -> Callable[[np.ndarray], None]:
        header = number.to_bytes(2, "little")

        def send(blocks: np.ndarray) -> None:
            message = header + blocks[:_MAX_BLOCKS].astype("<i8").tobytes()
            for address in peers:
                with contextlib.suppress(OSError):  # a full buffer drops the message
                    own.sendto(message, address)

        return send

    @staticmethod
    def _receive(own: socket.socket, engines: list[Engine], served: ServedPrompts | None) -> None:
        now = time.monotonic()
        for _ in range(64):  # bounded: let requests run between bursts
            try:
                message = own.recv(_BUFFER_BYTES)
            except BlockingIOError:
                return
            number = int.from_bytes(message[:2], "little")
            blocks = np.frombuffer(message[2:], dtype="<i8")
            if number == _GLOBAL_TIER and served is not None:
                served.learn(blocks)
            elif number < len(engines):
                engines[number].view.learn(blocks, now)


@dataclass
class CrashLoop:
    """When the supervisor forks a dead worker again: at once after a life of
    ``steady_s`` or more; after a quicker death, after a backoff that doubles with each
    quick death in a row; after ``give_up_after`` of those, never: a worker that cannot
    stay up would only hide its error behind restarts, so the service stops and says so."""

    steady_s: float = 30.0
    first_backoff_s: float = 0.5
    give_up_after: int = 5
    quick: dict[int, int] = field(default_factory=dict)

    def died(self, worker: int, lived_s: float) -> float | None:
        """Seconds to wait before forking ``worker`` again; None: give up."""
        if lived_s >= self.steady_s:
            self.quick[worker] = 0
            return 0.0
        deaths = self.quick[worker] = self.quick.get(worker, 0) + 1
        if deaths > self.give_up_after:
            return None
        return self.first_backoff_s * 2 ** (deaths - 1)


def _fork_workers(router: Router, sockets: list[socket.socket]) -> None:
    """Fork a copy of ``router`` onto each of ``sockets`` and keep them running
    (``_supervise``) until SIGINT or SIGTERM."""
    workers = len(sockets)
    engines = router.engines
    shared = mmap.mmap(-1, 8 * LOAD_COLUMNS * workers * len(engines))  # MAP_SHARED: survives fork
    load = np.frombuffer(shared, dtype=np.int64).reshape(workers, len(engines), LOAD_COLUMNS)
    peers = PeerViews(workers)

    def start(worker: int) -> int:
        """Fork worker ``worker`` on its socket, which this process keeps open for the
        next one should it die (connections the kernel gives it meanwhile wait there)."""
        load[worker] = 0  # a dead worker's requests died with it
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                for signum in (signal.SIGTERM, signal.SIGINT):  # not the supervisor's
                    signal.signal(signum, signal.SIG_DFL)
                for number, engine in enumerate(engines):
                    engine.share_load(load[:, number], worker)
                app = router.app()
                tier = router.core.global_tier
                served = tier if isinstance(tier, ServedPrompts) else None
                app.cleanup_ctx.append(peers.join(engines, worker, served))
                for other, sock in enumerate(sockets):
                    if other != worker:
                        sock.close()
                _run(app, sockets[worker], router.settings.drain_timeout_s)
            except BaseException:
                log.exception("router worker %d failed", worker)
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        return pid

    def close_sockets() -> None:
        for sock in sockets:
            sock.close()

    _supervise(start, workers, CrashLoop(), close_sockets)


def _supervise(
    start: Callable[[int], int],
    workers: int,
    crashes: CrashLoop,
    stopped: Callable[[], None] = lambda: None,
) -> None:
    """Start the workers and wait on them. One that dies (whatever killed it) is logged
    with its exit code or signal and started again, as ``crashes`` says; a signal to this
    process stops them all, and ``stopped`` lets go of what this process held for them
    (the listening sockets, so that new connections are refused at once). Exits 1 when
    it gave up on a worker."""
    children = {start(worker): worker for worker in range(workers)}
    born = dict.fromkeys(range(workers), time.monotonic())
    stopping = False
    gave_up = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopped()
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while children:
        pid, status = os.wait()
        worker = children.pop(pid, None)
        forget_process(pid)
        if worker is None or stopping:
            continue
        code = os.waitstatus_to_exitcode(status)
        cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        wait_s = crashes.died(worker, time.monotonic() - born[worker])
        event: dict[str, object] = {
            "event": "worker_died",
            "worker": worker,
            "pid": pid,
            "cause": cause,
        }
        if wait_s is None:
            event |= {"event": "worker_gave_up", "deaths": crashes.give_up_after + 1}
            log.error(json.dumps(event))
            gave_up = True
            stop(signal.SIGTERM, None)
            continue
        log.error(json.dumps({**event, "restart_in_s": wait_s}))
        time.sleep(wait_s)
        if not stopping:
            children[start(worker)] = worker
            born[worker] = time.monotonic()
    if gave_up:
        raise SystemExit(1)
