"""Codex CLI, installed from npm, runs two turns through ``smetric serve`` and through
``smetric pick`` behind Envoy, in front of agent-mode engines: ``codex exec``, then
``codex exec resume --last``.

Codex speaks only the Responses API. It is pointed at the router by a custom provider in
its ``config.toml``, the one docs/concepts/serving-layer.md gives; it sends its whole
conversation on every request (``store: false``) and names its session in ``session-id``.
Its HTTP proxy is a loopback trap: any connection Codex tries beyond loopback lands there,
and the test fails if one did.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from harnesses import (
    FRONT_DOORS,
    Recording,
    Trap,
    agent_engines,
    base_env,
    check_routing,
    documented_block,
    front_door,
    harness_binary,
    proxy_trap,
    recording,
    run_harness,
)

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

SESSION_HEADER = "session-id"


def documented_config(router: str) -> str:
    """The ``config.toml`` the docs give for Codex, pointed at ``router``."""
    return documented_block("concepts/serving-layer.md", "The Responses API", "toml", router)


async def two_turns(front: str, workdir: Path, trap: Trap) -> Recording:
    """``codex exec`` and then ``codex exec resume --last`` in a folder holding one file."""
    codex = harness_binary("codex")
    project, home = workdir / "project", workdir / "codex-home"
    project.mkdir(parents=True)
    home.mkdir()
    (project / "README.md").write_text("# demo\n\nA tiny project.\n")
    async with recording(front) as record:
        (home / "config.toml").write_text(documented_config(record.url))
        env = {
            **base_env(workdir / "home"),
            **trap.env,
            "CODEX_HOME": str(home),
            "SMETRIC_API_KEY": "sk-smetric-test",
        }
        for args in (
            ["exec", "--skip-git-repo-check", "List the files here."],
            ["exec", "--skip-git-repo-check", "resume", "--last", "And now?"],
        ):
            run = await run_harness([codex, *args], project, env)
            assert run.returncode == 0, (args, run.stdout[-2000:], run.stderr[-3000:])
    return record


@pytest.mark.parametrize("kind", FRONT_DOORS)
def test_codex_exec_twice_through_the_front_door(kind: str, tmp_path: Path) -> None:
    harness_binary("codex")
    with (
        agent_engines(tmp_path) as engines,
        front_door(kind, engines, tmp_path) as door,
        proxy_trap() as trap,
    ):
        record = asyncio.run(two_turns(door.url, tmp_path / "run", trap))
        metrics = door.metrics()
    assert trap.caught == [], [c.split(b"\r\n")[0] for c in trap.caught]  # loopback only
    check_routing(record, metrics, "codex", SESSION_HEADER)
    for exchange in record.routed():
        assert exchange.path == "/v1/responses"
        assert exchange.body["store"] is False
    # The second run resumes the first's session, its history resent.
    assert len({e.headers[SESSION_HEADER] for e in record.routed()}) == 1
    last = str(record.routed()[-1].body["input"])
    assert "List the files here." in last and "And now?" in last
