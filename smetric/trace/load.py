"""One entry point for every trace format: detect, load, and round-trip through Parquet."""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import polars as pl

from smetric.trace import azure, bailian, mooncake, recording, weka
from smetric.trace.formats import FORMATS
from smetric.trace.schema import SCHEMA, Trace, TraceError

SAMPLES = {
    "weka": "weka-claude-code",
    "mooncake": "mooncake/conversation_trace_head.jsonl",
}
DEFAULT_SAMPLE = "sample:weka"
_METADATA_KEY = "smetric.trace"


def sample_path(name: str) -> Path:
    """Where an embedded sample lives inside the installed package."""
    if name not in SAMPLES:
        raise TraceError(f"sample:{name}", f"unknown sample; choose from {', '.join(SAMPLES)}")
    root = resources.files("smetric") / "data" / "samples"
    return Path(str(root / SAMPLES[name]))


def resolve(source: str | Path) -> Path:
    """A path, or ``sample:NAME`` for a trace shipped with the package. ``~`` and
    environment variables (``$SMETRIC_TRACES/...``) are expanded, so a preset can name a
    trace that lives in a different place on every machine."""
    text = str(source)
    if text.startswith("sample:"):
        return sample_path(text.removeprefix("sample:"))
    expanded = os.path.expandvars(text)
    unset = re.findall(r"\$\{?(\w+)", expanded)
    if unset:
        raise TraceError(text, f"environment variable {unset[0]} is not set")
    path = Path(expanded).expanduser()
    if not path.exists():
        raise TraceError(path, "no such file or folder")
    return path


def _first_line(path: Path) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return line
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, f"cannot read file: {exc}") from exc
    raise TraceError(path, "file is empty")


def detect_format(path: Path) -> str:
    """Guess the format from the name and, for JSON lines, the first record's fields."""
    name = path.name.lower()
    if recording.is_recording(path):
        return "recording"
    if path.is_dir() or name.endswith((".json", ".json.gz")):
        return "weka"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".csv", ".csv.gz")):
        return "azure"
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        try:
            record = json.loads(_first_line(path))
        except json.JSONDecodeError as exc:
            raise TraceError(path, f"first record is not JSON: {exc.msg}", line=1) from exc
        if isinstance(record, dict) and "chat_id" in record:
            return "bailian"
        if isinstance(record, dict) and "hash_ids" in record:
            return "mooncake"
        raise TraceError(
            path, "JSON lines with neither Bailian (chat_id) nor Mooncake (hash_ids) fields"
        )
    raise TraceError(path, f"unknown trace format; name it with --format ({', '.join(FORMATS)})")


def load_trace(
    source: str | Path,
    fmt: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Trace:
    """Load any supported trace; ``progress`` is told of each session file read (WEKA)."""
    path = resolve(source)
    fmt = fmt or detect_format(path)
    if fmt == "weka":
        return weka.load(path, progress)
    loaders: dict[str, Callable[[Path], Trace]] = {
        "mooncake": mooncake.load,
        "bailian": bailian.load,
        "azure": azure.load,
        "parquet": read_parquet,
        "recording": recording.load,
    }
    if fmt not in loaders:
        raise TraceError(path, f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    return loaders[fmt](path)


def count_units(source: str | Path) -> int:
    """How many progress steps loading takes (session files for a WEKA folder, else 1)."""
    path = resolve(source)
    if not path.is_dir() or recording.is_recording(path):
        return 1
    return len(weka.session_files(path))


def write_parquet(trace: Trace, path: Path) -> None:
    meta = {
        "name": trace.name,
        "source_format": trace.source_format,
        "has_clock": trace.has_clock,
        "sessions_inferred": trace.sessions_inferred,
        "notes": list(trace.notes),
        "skipped": dict(trace.skipped),
    }
    trace.requests.write_parquet(path, metadata={_METADATA_KEY: json.dumps(meta)})


def read_parquet(path: Path) -> Trace:
    try:
        meta = json.loads(pl.read_parquet_metadata(path).get(_METADATA_KEY, "{}"))
        frame = pl.read_parquet(path)
    except Exception as exc:  # polars raises several unrelated types for a bad file
        raise TraceError(path, f"not a readable Parquet file: {exc}") from exc
    missing = [c for c in SCHEMA if c not in frame.columns]
    if missing:
        raise TraceError(path, f"not an SMetric request table: missing columns {missing}")
    return Trace(
        requests=frame.select([pl.col(c).cast(t) for c, t in SCHEMA.items()]),
        name=meta.get("name", path.stem),
        source_format=meta.get("source_format", "parquet"),
        has_clock=bool(meta.get("has_clock", frame["arrival_s"].is_not_null().all())),
        sessions_inferred=bool(meta.get("sessions_inferred", False)),
        notes=tuple(meta.get("notes", ())),
        skipped=meta.get("skipped", {}),
    )
