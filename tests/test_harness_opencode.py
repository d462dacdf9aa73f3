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
    front_door,
    harness_binary,
    recording,
    run_harness,
)

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

SESSION_HEADER = "x-session-id"


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "agents.md"


def opencode_config(base_url: str) -> dict[str, object]:
    """The ``opencode.json`` the guide gives, read from the guide itself so the two cannot
    drift apart: an OpenAI-compatible provider on the front door's ``/v1``."""
    section = GUIDE.read_text().split("## OpenCode", 1)[1]
    block = section.split("```json\n", 1)[1].split("```", 1)[0]
    text = block.replace("http://ROUTER:8000", base_url).replace('"KEY"', '"sk-smetric-test"')
    return json.loads(text)


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
