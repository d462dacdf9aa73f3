"""Simulation runs on a Ray cluster (``pip install 'smetric[ray]'``), for sweeps too big for
one machine's cores.

The trace is put in Ray's object store once; each node fetches it once and each worker
process deserialises it once, on its first run (later runs of the same sweep reuse it).
This driver keeps at most as many runs in flight on each node as it has CPUs, pinning each
run to its node (softly: a run on a node that dies moves on), so it knows at every moment
what runs where, for the progress display, and a node of 64 cores takes 64 runs at once.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections import Counter, deque
from pathlib import Path
from typing import Any

from smetric.core.errors import ConfigError
from smetric.sim.jobs import Events, Job, Task
from smetric.trace.schema import Trace

# No square brackets: the CLI prints errors as Rich markup.
INSTALL_HINT = "sweeps on Ray need Ray installed: pip install 'ray>=2.40,<3' (smetric's ray extra)"

# The trace of the sweep this worker process serves, by object id.
_cached: dict[str, Trace] = {}


def _run(boxed: list, job: Job, task: Task) -> Any:
    """One run on a Ray worker; the trace comes boxed so that Ray does not fetch it anew."""
    import ray

    ref = boxed[0]
    if ref.hex() not in _cached:
        _cached.clear()
        _cached[ref.hex()] = ray.get(ref)
    return task(_cached[ref.hex()], job)


def connect(address: str) -> bool:
    """Join the cluster at ``address`` (``auto``, ``local``, ``HOST:PORT``, ``ray://...``).

    Returns whether this call started the connection (and so should end it). ``local``
    starts a one-machine cluster for this process in Ray's single-machine mode (the one it
    uses on macOS), whose servers all listen on loopback only.
    """
    if address == "local":
        # Read by Ray when it is imported: keep before the import.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"log_to_driver": False, "logging_level": "ERROR"}
    if address == "local":
        options["include_dashboard"] = False
    else:
        check_reachable(address)
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address}: {exc}") from None
    return True


# Where ``ray start`` leaves the address of the cluster it started (``ray.init``'s docs).
CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail within seconds, with what to do, when no Ray cluster answers at ``address``:
    Ray itself prints a traceback (``auto`` with no cluster) or retries for minutes (a
    head that does not answer)."""
    target = address
    if address == "auto":
        target = os.environ.get("RAY_ADDRESS", "").strip()
        if not target and CURRENT_CLUSTER.is_file():
            target = CURRENT_CLUSTER.read_text().strip()
        if not target or target == "auto":
            raise ConfigError(
                "--ray auto: no Ray cluster runs on this machine (start one with "
                "`ray start --head`, or use --ray local for a one-machine cluster)"
            )
    host, _, port = target.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray {address}: expected auto, local, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"--ray {address}: no Ray cluster answers at {host}:{port} ({exc}); is its head "
            "running (`ray start --head`) and reachable?"
        ) from None


def map_on_ray(address: str, trace: Trace, jobs: list[Job], task: Task) -> Events:
    """``task(trace, job)`` for every job on the cluster, as they finish, with the runs then
    in flight per node (by address); first (None, None, in flight) once runs start."""
    started = connect(address)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        nodes = {
            n["NodeID"]: (n["NodeManagerAddress"], int(n["Resources"].get("CPU", 0)))
            for n in ray.nodes()
            if n["Alive"] and n["Resources"].get("CPU", 0) >= 1
        }
        if not nodes:
            raise ConfigError(f"the Ray cluster at {address!r} has no node with a CPU")
        remote = ray.remote(num_cpus=1)(_run)
        boxed = [ray.put(trace)]
        pending = deque(jobs)
        running: dict[Any, tuple[Job, str]] = {}
        busy: Counter[str] = Counter()

        def fill() -> None:
            for node, (_, cpus) in nodes.items():
                while pending and busy[node] < cpus:
                    job = pending.popleft()
                    where = NodeAffinitySchedulingStrategy(node, soft=True)
                    ref = remote.options(scheduling_strategy=where).remote(boxed, job, task)
                    running[ref] = (job, node)
                    busy[node] += 1

        def inflight() -> dict[str, int]:
            return {nodes[n][0]: count for n, count in busy.items() if count}

        fill()
        yield None, None, inflight()
        while running:
            (ready,), _ = ray.wait(list(running), num_returns=1)
            job, node = running.pop(ready)
            busy[node] -= 1
            result = ray.get(ready)
            fill()
            yield job, result, inflight()
    finally:
        if started:
            ray.shutdown()
