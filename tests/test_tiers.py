"""The tier marks are checked: a test that listens or starts a process without its mark
fails, so that the fast tier (``make check``) cannot silently grow slow."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# The inner run listens in this process, so this test is in the server tier itself.
pytestmark = pytest.mark.server

LISTENS = """
import socket

import pytest


def listen():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()


def test_unmarked():
    listen()


@pytest.mark.server
def test_marked():
    listen()
"""


def test_a_test_that_listens_needs_the_server_mark(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(LISTENS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_unmarked*it listens on a socket*pytest.mark.server*"])
