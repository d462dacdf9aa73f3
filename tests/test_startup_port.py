"""Reading a server subprocess's bound port from its startup line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from smetric.testing.ports import read_startup_port

pytestmark = pytest.mark.subprocess


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_the_port_is_read_and_the_pipe_drained_after_it() -> None:
    # After its startup line the child writes far more than a pipe holds (64 KiB) and
    # exits only if someone reads it.
    child = _child(
        "import sys\n"
        "print('smetric serve: routing on http://127.0.0.1:4321 (policy x)', flush=True)\n"
        "sys.stdout.write('x' * 1_000_000 + '\\n'); sys.stdout.flush()\n"
    )
    assert child.stdout is not None
    assert read_startup_port(child.stdout, child, timeout_s=30) == 4321
    assert child.wait(timeout=30) == 0


def test_a_silent_child_fails_at_the_deadline_not_never() -> None:
    child = _child("import time; time.sleep(60)")
    assert child.stdout is not None
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"no startup line within 0\.5 s"):
            read_startup_port(child.stdout, child, timeout_s=0.5)
        assert time.monotonic() - started < 10
    finally:
        child.kill()
        child.wait()


def test_a_child_that_exits_first_is_an_error_with_what_it_said() -> None:
    child = _child("print('cannot start: port in use')")
    assert child.stdout is not None
    with pytest.raises(RuntimeError, match="cannot start: port in use"):
        read_startup_port(child.stdout, child, timeout_s=30)
    child.wait()
