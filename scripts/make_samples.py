"""Rebuild the embedded sample traces from the full public traces (run from the repo root).

    python scripts/make_samples.py TRACES   # the folder holding weka-claude-code/ and mooncake/

WEKA: the smallest sessions of the two most common agent frameworks (so the sample shows
system-prompt reuse across sessions), a few with sub-agents, and sessions spread over the
size range of the rest.
Mooncake: the first 1,000 requests.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

SAMPLES = Path("smetric/data/samples")
PER_TOP_FRAMEWORK = (10, 8)
SPREAD = 14
WITH_SUBAGENTS = 3
MOONCAKE_LINES = 1000


def framework(path: Path) -> str:
    session = json.loads(gzip.decompress(path.read_bytes()))
    if any(r.get("type") == "subagent" for r in session["requests"]):
        return "with-subagents"
    model = session["models"][0] if session.get("models") else ""
    return f"{model}|{session.get('tool_tokens', 0)}|{session.get('system_tokens', 0)}"


def pick_weka(folder: Path) -> list[Path]:
    by_size = sorted(folder.glob("*.json.gz"), key=lambda p: (p.stat().st_size, p.name))
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in by_size:
        groups[framework(path)].append(path)
    subagents = groups.pop("with-subagents", [])
    top = sorted(groups.values(), key=len, reverse=True)
    chosen = [p for group, n in zip(top, PER_TOP_FRAMEWORK, strict=False) for p in group[:n]]
    chosen += subagents[:WITH_SUBAGENTS]
    rest = [p for p in by_size if p not in chosen]
    step = len(rest) // SPREAD
    chosen += rest[step // 2 :: step][:SPREAD]
    return sorted(chosen)


def main(traces: Path) -> None:
    weka = SAMPLES / "weka-claude-code"
    shutil.rmtree(weka, ignore_errors=True)
    weka.mkdir(parents=True)
    for path in pick_weka(traces / "weka-claude-code"):
        shutil.copyfile(path, weka / path.name)
    lines = (traces / "mooncake" / "conversation_trace.jsonl").read_text().splitlines(True)
    (SAMPLES / "mooncake").mkdir(parents=True, exist_ok=True)
    head = "".join(lines[:MOONCAKE_LINES])
    (SAMPLES / "mooncake" / "conversation_trace_head.jsonl").write_text(head)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
