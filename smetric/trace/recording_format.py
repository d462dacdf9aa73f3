"""The on-disk format of a recording folder, shared by its writer and its reader.

``smetric.record`` writes a folder (a manifest and Parquet segments) while serving;
``trace.recording`` loads it as a trace. Both sides name the files, the metadata key and
the columns from here, so the reader does not depend on the serving-side writer and the
two cannot drift apart.
"""

from __future__ import annotations

import polars as pl

FORMAT = "smetric-recording"
VERSION = 1
MANIFEST = "recording.json"
SEGMENT_GLOB = "requests-*.parquet"
METADATA_KEY = "smetric.recording"

SEGMENT_SCHEMA: dict[str, pl.DataType] = {
    # Wall-clock seconds (Unix time) when the request arrived and when its response ended.
    "arrival_s": pl.Float64(),
    "completion_s": pl.Float64(),
    # Prompt tokens as the router counted them (the units of its blocks), the output
    # tokens and cached prompt tokens the engine reported (null where it did not).
    "prompt_tokens": pl.Int64(),
    "output_tokens": pl.Int64(),
    "cached_tokens": pl.Int64(),
    "turn": pl.Int32(),
    # Salted names: the harness's session (else the conversation), the agent (the
    # harness's, else the conversation) and the agent that spawned it (harness only).
    "session": pl.Int64(),
    "agent": pl.Int64(),
    "parent_agent": pl.Int64(),
    # user, agent or unknown from the body; the loader adds compaction.
    "trigger": pl.String(),
    "engine": pl.String(),
    "branch": pl.String(),
    # The prompt's salted block ids, stored as the leading ``shared_blocks`` of an earlier
    # row of the same segment (``base_row``, the agent's latest request there) followed by
    # ``new_block_ids``: a follow-up re-sends its history, which is then written once.
    "base_row": pl.Int32(),
    "shared_blocks": pl.Int32(),
    "new_block_ids": pl.List(pl.Int64()),
}
