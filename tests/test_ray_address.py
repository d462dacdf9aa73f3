"""``sweep --ray``: an address with no cluster behind it fails within seconds, clearly."""

from __future__ import annotations

import socket
import time

import pytest

from smetric.sim import ray_runner


def test_auto_with_no_cluster_says_how_to_start_one(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_runner, "CURRENT_CLUSTER", tmp_path / "ray_current_cluster")
    with pytest.raises(ValueError, match="no Ray cluster runs on this machine"):
        ray_runner.check_reachable("auto")


def test_an_address_nothing_answers_at_fails_fast() -> None:
    with socket.socket() as listener:  # bound, never listening: connections are refused
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ValueError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
            ray_runner.check_reachable(f"127.0.0.1:{port}", timeout_s=2.0)
        assert time.monotonic() - started < 5.0


@pytest.mark.server
def test_auto_follows_the_address_ray_start_left(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        current = tmp_path / "ray_current_cluster"
        current.write_text(f"127.0.0.1:{server.getsockname()[1]}\n")
        monkeypatch.setattr(ray_runner, "CURRENT_CLUSTER", current)
        ray_runner.check_reachable("auto")


def test_a_malformed_address_names_the_forms() -> None:
    with pytest.raises(ValueError, match="expected auto, local, HOST:PORT"):
        ray_runner.check_reachable("nowhere")
