"""Claude Code, installed from npm, runs two turns through ``smetric serve`` and through
``smetric pick`` behind Envoy, with its default model, in front of agent-mode engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from harnesses import (
    FRONT_DOORS,
    Recording,
    agent_engines,
    base_env,
    check_routing,
    documented_block,
    front_door,
    harness_binary,
    recording,
    run_harness,
)

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

SESSION_HEADER = "x-claude-code-session-id"


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """The environment the guide gives, read from the guide itself so the two cannot drift
    apart: the front door's root as the base URL, a key, and everything that would reach
    past the router turned off."""
    block = documented_block("guides/agents.md", "Claude Code", "bash", base_url)
    env = {}
    for line in block.splitlines():
        if line.startswith("export "):
            for pair in line.split("#", 1)[0].split()[1:]:
                name, value = pair.split("=", 1)
                env[name] = value
    env["ANTHROPIC_API_KEY"] = "sk-smetric-test"
    return {**base_env(home), **env}


async def two_turns(front: str, workdir: Path) -> Recording:
    """``claude -p`` and then ``claude -p --continue`` in a folder holding one file."""
    claude = harness_binary("claude")
    (workdir / "project").mkdir(parents=True)
    (workdir / "project" / "README.md").write_text("# demo\n\nA tiny project.\n")
    async with recording(front) as record:
        env = claude_env(workdir / "home", record.url)
        for args in (["-p", "List the files here."], ["-p", "--continue", "And now?"]):
            run = await run_harness([claude, *args], workdir / "project", env)
            assert run.returncode == 0, (args, run.stdout[-2000:], run.stderr[-3000:])
            assert run.stdout.strip()
    return record


def check_claude(record: Recording, metrics: str) -> None:
    check_routing(record, metrics, "claude-code", SESSION_HEADER)
    for exchange in record.routed():
        assert exchange.path.split("?")[0] == "/v1/messages"
        assert exchange.headers.get("anthropic-version")
    # The second run continues the first's conversation: the same session, its history
    # resent, and a system message inside ``messages`` (refused once) routed like any.
    sessions = {e.headers[SESSION_HEADER] for e in record.routed()}
    assert len(sessions) == 1
    last = record.routed()[-1].body["messages"]
    assert "List the files here." in str(last) and "And now?" in str(last)
    assert any(m["role"] == "system" for m in last)


@pytest.mark.parametrize("kind", FRONT_DOORS)
def test_claude_code_two_turns_through_the_front_door(kind: str, tmp_path: Path) -> None:
    harness_binary("claude")
    with agent_engines(tmp_path) as engines, front_door(kind, engines, tmp_path) as door:
        record = asyncio.run(two_turns(door.url, tmp_path / "run"))
        metrics = door.metrics()
    check_claude(record, metrics)
