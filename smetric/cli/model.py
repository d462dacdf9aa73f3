"""``smetric model`` and ``smetric fidelity``: ask the performance model, check it."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer

from smetric.cli.app import app, console, user_errors
from smetric.cli.settings_options import Given, setting_flags, with_setting_flags
from smetric.cli.sim_options import NAMES
from smetric.core.errors import UserError
from smetric.core.settings_load import load
from smetric.model import fidelity
from smetric.model.fidelity import decode_step, prefill_seconds
from smetric.model.perf import (
    MEDIUM_NAMES,
    Hardware,
    ModelSpec,
    StepTimeModel,
    kv_bytes_per_token,
    kv_capacity_tokens,
    load_hardware,
    load_medium,
    load_model,
)
from smetric.report.stamp import write_results_page
from smetric.report.tables import Column, Table, print_table
from smetric.sim.cluster import lane_gb_s
from smetric.sim.config import ClusterConfig

PRESETS = "Presets"
QUESTIONS = "Questions"


def _opt(help_text: str, panel: str, *names: str, **kwargs: Any) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **kwargs)


def with_overrides(
    hardware: Hardware, model: ModelSpec, path: Path | None
) -> tuple[Hardware, ModelSpec]:
    """The named presets with the fields a user's TOML file gives in ``[hardware]`` and
    ``[model]`` (any field of ``presets/hardware.toml`` or ``models.toml``)."""
    if path is None:
        return hardware, model
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{path}: cannot read TOML: {exc}") from exc
    unknown_tables = sorted(set(data) - {"hardware", "model"})
    if unknown_tables:
        raise UserError(f"{path}: unknown tables {unknown_tables}; use [hardware] and [model]")
    out: list[Any] = []
    for table, preset in (("hardware", hardware), ("model", model)):
        given = data.get(table, {})
        if not isinstance(given, dict):
            raise UserError(f"{path}: [{table}] must be a table of fields")
        for f in dataclasses.fields(preset):
            if f.name in given and "chosen_by" in f.metadata:
                raise UserError(
                    f"{path}: [{table}] cannot set {f.name}; {f.metadata['chosen_by']} sets it"
                )
        out.append(load(type(preset), {**dataclasses.asdict(preset), **given}, str(path), table))
    return out[0], out[1]


def answers(
    hardware: Hardware,
    model: ModelSpec,
    *,
    weight_dtype: str,
    kv_dtype: str,
    mem_util: float,
    batched_tokens: int,
    new: int,
    cached: int,
    batch: int,
    context: int,
    load_tokens: int,
    media: tuple[str, ...],
) -> dict[str, Any]:
    """The four questions a capacity planner asks, answered by the same model the simulator
    steps with."""
    perf = StepTimeModel(model, hardware, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    prefill = prefill_seconds(perf, new, batched_tokens, cached)
    step = decode_step(perf, batch, context)
    room = kv_capacity_tokens(
        model,
        hardware,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        gpu_memory_utilization=mem_util,
        max_num_batched_tokens=batched_tokens,
    )
    kv_bytes = kv_bytes_per_token(model, kv_dtype)
    nbytes = load_tokens * kv_bytes
    defaults = ClusterConfig()
    nics_gb_s = defaults.nics_per_server * defaults.nic_gb_s
    loads = {}
    for name in media:
        medium = load_medium(name)
        cluster = dataclasses.replace(defaults, gpus_per_instance=hardware.gpus, global_medium=name)
        link = min(lane_gb_s(cluster), nics_gb_s)
        loads[name] = {
            "seconds": medium.setup_s + nbytes / (link * 1e9),
            "effective_gb_s": nbytes / (medium.setup_s + nbytes / (link * 1e9)) / 1e9,
        }
    return {
        "hardware": f"{hardware.gpus}x{hardware.name}",
        "model": model.name,
        "weight_dtype": weight_dtype,
        "kv_dtype": kv_dtype,
        "prefill": {
            "new_tokens": new,
            "cached_tokens": cached,
            "chunk": batched_tokens,
            "seconds": prefill,
            "tokens_per_s": new / prefill if prefill else 0.0,
        },
        "decode_step": {
            "batch": batch,
            "mean_context": context,
            "seconds": step,
            "output_tokens_per_s": batch / step,
        },
        "kv_room": {
            "tokens": room,
            "bytes_per_token": kv_bytes,
            "gpu_memory_utilization": mem_util,
            "max_num_batched_tokens": batched_tokens,
        },
        "global_tier_load": {
            "tokens": load_tokens,
            "bytes": nbytes,
            "recompute_seconds": prefill_seconds(perf, load_tokens, batched_tokens),
            "media": loads,
        },
    }


def answers_table(result: dict[str, Any]) -> Table:
    title = (
        f"{result['model']} ({result['weight_dtype']}, KV {result['kv_dtype']}) "
        f"on {result['hardware']}"
    )
    p, d, k, g = (result[key] for key in ("prefill", "decode_step", "kv_room", "global_tier_load"))
    rows = [
        (
            f"prefill {p['new_tokens']:,} new tokens after {p['cached_tokens']:,} cached "
            f"({p['chunk']:,}-token chunks)",
            f"{p['seconds']:.3f} s",
            f"{p['tokens_per_s']:,.0f} tok/s",
        ),
        (
            f"decode step, batch {d['batch']} at mean context {d['mean_context']:,}",
            f"{d['seconds'] * 1e3:.2f} ms",
            f"{d['output_tokens_per_s']:,.0f} tok/s",
        ),
        (
            f"KV room at utilisation {k['gpu_memory_utilization']} "
            f"({k['max_num_batched_tokens']:,} batched tokens profiled)",
            f"{k['tokens']:,} tokens",
            f"{k['bytes_per_token']:,} B/token",
        ),
        (
            f"recompute {g['tokens']:,} tokens instead of loading them",
            f"{g['recompute_seconds']:.2f} s",
            "",
        ),
    ]
    for name, transfer in g["media"].items():
        rows.append(
            (
                f"load {g['tokens']:,} tokens ({g['bytes'] / 1e9:.2f} GB) over {name}",
                f"{transfer['seconds']:.3f} s",
                f"{transfer['effective_gb_s']:.1f} GB/s",
            )
        )
    columns = (Column("question", "left", wrap=True), Column("answer"), Column("rate"))
    values = tuple({"question": q, "answer": a, "rate": r} for q, a, r in rows)
    return Table("answers", title, columns, tuple(rows), values)


# The cluster settings that shape one instance: the simulator's own flags and defaults.
INSTANCE = (
    "model",
    "hardware",
    "gpus_per_instance",
    "weight_dtype",
    "kv_dtype",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
)
INSTANCE_FLAGS = tuple(
    flag
    for flag in setting_flags(ClusterConfig, "cluster", panel=PRESETS, names=NAMES)
    if flag.field in INSTANCE
)


@app.command(name="model")
@with_setting_flags(INSTANCE_FLAGS)
def model_command(
    given: Given,
    preset_file: Annotated[
        Path | None,
        _opt(
            "Your own presets: a TOML file whose [hardware] and [model] tables override any "
            "field of the named presets (for a GPU or model not listed, give them all).",
            PRESETS,
            "--preset-file",
        ),
    ] = None,
    new: Annotated[int, _opt("Prefill: new tokens to compute.", QUESTIONS, min=1)] = 8192,
    cached: Annotated[
        int, _opt("Prefill: tokens already cached before them.", QUESTIONS, min=0)
    ] = 0,
    batch: Annotated[int, _opt("Decode step: sequences in the batch.", QUESTIONS, min=1)] = 32,
    context: Annotated[
        int, _opt("Decode step: mean context per sequence, tokens.", QUESTIONS, min=0)
    ] = 8192,
    load_tokens: Annotated[
        int, _opt("Global-tier load: tokens of KV to move.", QUESTIONS, min=1)
    ] = 100_000,
    medium: Annotated[
        str | None,
        _opt(
            f"Global-tier medium: {', '.join(MEDIUM_NAMES)} [default: all of them].",
            QUESTIONS,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Ask the performance model directly: prefill time, decode step, KV room, tier loads.

    The same step-time model, KV sizing and global-tier media the simulator runs on, for
    one instance of any hardware and model preset (or your own, with --preset-file):

    - how long N new tokens take to prefill after C cached ones;
    - how long one decode step of B sequences at mean context C takes;
    - how many tokens of KV the instance holds, sized as vLLM sizes its pool;
    - how long loading N tokens of KV from the global tier takes over each medium, beside
      recomputing them.

    `smetric fidelity` shows how close the model comes to public measurements.
    """
    cluster = dataclasses.replace(ClusterConfig(), **given.section("cluster"))
    with user_errors():
        hw, spec = with_overrides(
            load_hardware(cluster.hardware, cluster.gpus_per_instance),
            load_model(cluster.model),
            preset_file,
        )
        media = (load_medium(medium).name,) if medium else MEDIUM_NAMES
        result = answers(
            hw,
            spec,
            weight_dtype=cluster.weight_dtype or spec.weight_dtype,
            kv_dtype=cluster.kv_dtype,
            mem_util=cluster.gpu_memory_utilization,
            batched_tokens=cluster.max_num_batched_tokens,
            new=new,
            cached=cached,
            batch=batch,
            context=context,
            load_tokens=load_tokens,
            media=media,
        )
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    print_table(answers_table(result), console)


FIDELITY_TITLE = "Fidelity of the performance model"
FIDELITY_INTRO = """\
Every public measurement in `smetric/model/presets/anchors.toml` beside what the performance
model (`smetric model`) predicts for the same setup. *Fitted* rows are those the presets'
fitted values were fitted on; *held out* rows were not used and check them. The goal is
every row within ±15 %; a row outside says why. How each benchmark is rebuilt from the
step model, and which engine functions the model follows, is in
[the performance model](../concepts/performance-model.md)."""


@app.command(name="fidelity")
def fidelity_command(
    page: Annotated[
        Path | None,
        typer.Option(
            "--page",
            help="Also write the table as a results page at this path "
            "(docs/results/fidelity.md), stamped with the commit, date, machine and command.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The performance model against every public measurement it is checked on.

    One row per anchor: the setup, the measured figure, the model's figure and their ratio,
    whether the row was used to fit the presets or held out to check them, and for a row
    outside ±15 % the reason.
    """
    with user_errors():
        rows = fidelity.table_rows()
        summary = fidelity.summary()
        if page is not None:
            command = f"smetric fidelity --page {page}"
            write_results_page(page, FIDELITY_TITLE, fidelity.markdown(), command, FIDELITY_INTRO)
    if as_json:
        typer.echo(json.dumps({"summary": dataclasses.asdict(summary), "rows": rows}, indent=1))
        return
    keys = ("id", "unit", "measured", "model", "ratio", "role", "within")
    left = {"id", "unit", "role", "within"}
    columns = tuple(Column(k, "left" if k in left else "right") for k in keys)
    cells = tuple(tuple(r[k] for k in keys) for r in rows)
    # Rows outside the band are highlighted (their "within" cell).
    outside = frozenset((i, 6) for i, r in enumerate(rows) if r["within"] != "yes")
    print_table(Table("fidelity", FIDELITY_TITLE, columns, cells, tuple(rows), outside), console)
    console.print(fidelity.markdown().split("\n\n", 1)[0])
    if page is not None:
        console.print(f"wrote {page}")
