"""OpenCode, installed from npm, runs two turns through ``smetric serve`` with an
OpenAI-compatible provider, in front of agent-mode engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from harnesses import (
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

SESSION_HEADER = "x-session-id"


def opencode_config(base_url: str) -> dict[str, object]:
    """The ``opencode.json`` the guide gives, read from the guide itself so the two cannot
    drift apart: an OpenAI-compatible provider on the front door's ``/v1``."""
    block = documented_block("guides/agents.md", "OpenCode", "json", base_url)
    return json.loads(block.replace('"KEY"', '"sk-smetric-test"'))


async def two_turns(front: str, workdir: Path) -> Recording:
    """``opencode run`` and then ``opencode run --continue`` in a folder holding one file."""
    opencode = harness_binary("opencode")
    project = workdir / "project"
    project.mkdir(parents=True)
    (project / "README.md").write_text("# demo\n\nA tiny project.\n")
    async with recording(front) as record:
        (project / "opencode.json").write_text(json.dumps(opencode_config(record.url)))
        env = {
            **base_env(workdir / "home"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1",
        }
        for args in (["run", "List the files here."], ["run", "--continue", "And now?"]):
            run = await run_harness([opencode, *args], project, env)
            assert run.returncode == 0, (args, run.stdout[-2000:], run.stderr[-3000:])
    return record


def test_opencode_through_serve(tmp_path: Path) -> None:
    harness_binary("opencode")
    with agent_engines(tmp_path) as engines, front_door("serve", engines, tmp_path) as door:
        record = asyncio.run(two_turns(door.url, tmp_path / "run"))
        metrics = door.metrics()
    check_routing(record, metrics, "opencode", SESSION_HEADER)
    for exchange in record.routed():
        assert exchange.path == "/v1/chat/completions"
    last = record.routed()[-1].body["messages"]
    assert "List the files here." in str(last) and "And now?" in str(last)
