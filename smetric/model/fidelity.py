"""The performance model against public measurements: the fidelity table.

Every anchor in ``presets/anchors.toml`` is a serving benchmark someone ran, not a single
engine step, so each kind rebuilds its benchmark's steady state from
``StepTimeModel.step_time`` (or the KV sizing, or a global-tier medium) and compares the
figure it predicts with the measured one. Rows marked ``fit`` are the ones the presets'
fitted values came from; the others are held out, and the table reports both apart.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from smetric.model.perf import (
    HARDWARE_NAMES,
    StepTimeModel,
    kv_capacity_tokens,
    load_hardware,
    load_medium,
    load_model,
)

# A row within this fraction of its measurement meets the model's goal.
TOLERANCE = 0.15
# The prefill chunk (SGLang chunked_prefill_size, vLLM max_num_batched_tokens) where an
# anchor does not state it: 8192 is both engines' default on 80-141 GB GPUs.
DEFAULT_CHUNK = 8192
# Line rate of the links under a medium's connector: one PCIe Gen5 x16 lane (~50 GB/s).
LANE_GB_S = 50.0
# A prompt this long is long context: where the quadratic attention term dominates a step.
LONG_PROMPT = 64_000


@dataclass(frozen=True)
class Anchor:
    """One measured figure and how to rebuild the benchmark that produced it."""

    id: str
    setup: str
    kind: str
    measured: float
    unit: str
    fit: bool
    source: str
    why: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def model_value(self) -> float:
        return KINDS[self.kind](self.params)

    def ratio(self) -> float:
        return self.model_value() / self.measured

    @property
    def within(self) -> bool:
        return abs(self.ratio() - 1) <= TOLERANCE


_FIELDS = {"id", "setup", "kind", "measured", "unit", "fit", "source", "why"}


@cache
def anchors() -> tuple[Anchor, ...]:
    text = resources.files("smetric.model").joinpath("presets", "anchors.toml").read_text("utf-8")
    rows = tomllib.loads(text)["anchor"]
    out = []
    for row in rows:
        if row["kind"] not in KINDS:
            raise ValueError(f"anchor {row['id']}: unknown kind {row['kind']!r}")
        params = {k: v for k, v in row.items() if k not in _FIELDS}
        out.append(Anchor(**{k: v for k, v in row.items() if k in _FIELDS}, params=params))
    return tuple(out)


# -- rebuilding a benchmark from the step model ------------------------------------------


def step_model(params: dict[str, Any]) -> StepTimeModel:
    spec = load_model(params["model"])
    hardware = load_hardware(params["hardware"], params.get("gpus", 1))
    kv_dtype = params.get("kv_dtype", "bf16")
    return StepTimeModel(spec, hardware, weight_dtype=spec.weight_dtype, kv_dtype=kv_dtype)


def prefill_seconds(
    perf: StepTimeModel, prompt: int, chunk: int = DEFAULT_CHUNK, cached: int = 0
) -> float:
    """One prompt alone after ``cached`` tokens of hit, in chunks that each attend to
    everything before them."""
    total, done = 0.0, cached
    end = cached + prompt
    while done < end:
        n = min(chunk, end - done)
        total += perf.step_time(n, n * (done + n / 2), 0, 0)
        done += n
    return total


def decode_step(perf: StepTimeModel, batch: int, mean_context: float) -> float:
    return perf.step_time(0, 0.0, batch, round(batch * mean_context))


def request_seconds(params: dict[str, Any]) -> float:
    """Prefill, then ``output - 1`` decode steps; the step is affine in context, so the
    decode steps cost what the middle one does."""
    perf = step_model(params)
    prompt, output = params["prompt"], params["output"]
    chunk = params.get("chunk", DEFAULT_CHUNK)
    decode = (output - 1) * decode_step(perf, 1, prompt + output / 2)
    return prefill_seconds(perf, prompt, chunk) + decode


def prefill_tok_s(params: dict[str, Any]) -> float:
    perf = step_model(params)
    prompts, prompt = params["prompts"], params["prompt"]
    tokens = prompts * prompt
    return tokens / perf.step_time(tokens, prompts * prompt * prompt / 2, 0, 0)


def tpot_ms(params: dict[str, Any]) -> float:
    return 1e3 * decode_step(step_model(params), params["batch"], params["context"])


def ttft_ms(params: dict[str, Any]) -> float:
    """Mean TTFT of ``batch`` equal prompts arriving at once (vLLM V1 chunked prefill).

    Each step fills the token budget first come, first served; requests whose prefill
    is done decode alongside.
    """
    perf = step_model(params)
    prompt, requests = params["prompt"], params["batch"]
    budget = params.get("chunk", DEFAULT_CHUNK)
    left = [prompt] * requests
    clock, ttfts, decoding = 0.0, [], 0
    while any(left):
        room = budget - decoding
        prefill, attn2, finished = 0, 0.0, 0
        for i, remaining in enumerate(left):
            if room <= 0:
                break
            n = min(remaining, room)
            if n == 0:
                continue
            done = prompt - remaining
            prefill += n
            attn2 += n * (done + n / 2)
            room -= n
            left[i] -= n
            finished += left[i] == 0
        clock += perf.step_time(prefill, attn2, decoding, decoding * prompt)
        ttfts += [clock] * finished
        decoding += finished
    return 1e3 * sum(ttfts) / len(ttfts)


def kv_tokens(params: dict[str, Any]) -> float:
    spec = load_model(params["model"])
    hardware = load_hardware(params["hardware"], params.get("gpus", 1))
    return kv_capacity_tokens(
        spec,
        hardware,
        weight_dtype=spec.weight_dtype,
        kv_dtype=params.get("kv_dtype", "bf16"),
        gpu_memory_utilization=params.get("utilization", 0.9),
        max_num_batched_tokens=params.get("chunk", DEFAULT_CHUNK),
    )


def closed_tok_s(params: dict[str, Any]) -> float:
    """Output tokens/s of ``concurrency`` clients with fixed lengths, in steady state.

    Over one request lifetime the engine prefills ``concurrency`` new prompts (SGLang runs
    prefill batches apart from decode batches) and runs ``output`` decode steps of the
    whole batch at its mean context; the KV pool caps how many are in flight.
    """
    perf = step_model(params)
    prompt, output = params["prompt"], params["output"]
    pool = kv_tokens({**params, "chunk": params.get("chunk", DEFAULT_CHUNK)})
    concurrency = min(params["concurrency"], int(pool // (prompt + output)))
    busy = concurrency * prefill_seconds(perf, prompt) + output * decode_step(
        perf, concurrency, prompt + output / 2
    )
    return concurrency * output / busy


def load_gb_s(params: dict[str, Any]) -> float:
    medium = load_medium(params["medium"])
    nbytes = params["gb"] * 1e9
    return nbytes / medium.seconds(nbytes, LANE_GB_S) / 1e9


KINDS: dict[str, Callable[[dict[str, Any]], float]] = {
    "request_s": request_seconds,
    "prefill_tok_s": prefill_tok_s,
    "tpot_ms": tpot_ms,
    "ttft_ms": ttft_ms,
    "kv_tokens": kv_tokens,
    "closed_tok_s": closed_tok_s,
    "load_gb_s": load_gb_s,
}


# -- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    rows: int
    within: int
    fitted_rows: int
    fitted_within: int
    held_out_rows: int
    held_out_within: int
    fitted_mean_abs_error: float
    held_out_mean_abs_error: float
    explained_outside: int


def summary(rows: tuple[Anchor, ...] | None = None) -> Summary:
    rows = anchors() if rows is None else rows
    fitted = [a for a in rows if a.fit]
    held = [a for a in rows if not a.fit]

    def mae(group: list[Anchor]) -> float:
        inside = [abs(a.ratio() - 1) for a in group if a.within or not a.why]
        return sum(inside) / len(inside) if inside else 0.0

    return Summary(
        rows=len(rows),
        within=sum(a.within for a in rows),
        fitted_rows=len(fitted),
        fitted_within=sum(a.within for a in fitted),
        held_out_rows=len(held),
        held_out_within=sum(a.within for a in held),
        fitted_mean_abs_error=mae(fitted),
        held_out_mean_abs_error=mae(held),
        explained_outside=sum(1 for a in rows if not a.within and a.why),
    )


def long_context_rows(rows: tuple[Anchor, ...] | None = None) -> dict[str, int]:
    """Anchors with a prompt of ``LONG_PROMPT`` tokens or more, per GPU preset (0: none)."""
    rows = anchors() if rows is None else rows
    counts = dict.fromkeys((n for n in HARDWARE_NAMES if load_hardware(n).gpu), 0)
    for a in rows:
        if a.params.get("prompt", 0) >= LONG_PROMPT and a.params.get("hardware") in counts:
            counts[a.params["hardware"]] += 1
    return counts


def _figure(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:,.1f}"


def table_rows() -> list[dict[str, str]]:
    out = []
    for a in anchors():
        value = a.model_value()
        out.append(
            {
                "id": a.id,
                "setup": a.setup,
                "unit": a.unit,
                "measured": _figure(a.measured),
                "model": _figure(value),
                "ratio": f"{value / a.measured:.2f}",
                "role": "fitted" if a.fit else "held out",
                "within": "yes" if a.within else "no",
                "source": a.source,
                "why": a.why,
            }
        )
    return out


def markdown() -> str:
    """The fidelity table and its summary, as the docs page shows them."""
    s = summary()
    lines = [
        f"{s.rows} anchors, {s.within} within ±{TOLERANCE:.0%} of their measurement; "
        f"fitted rows {s.fitted_within} of {s.fitted_rows} "
        f"(mean error {s.fitted_mean_abs_error:.1%}), held-out rows {s.held_out_within} of "
        f"{s.held_out_rows} (mean error {s.held_out_mean_abs_error:.1%}); "
        f"{s.explained_outside} outside, each with its reason. Mean errors leave out the "
        "explained rows.",
        "",
        f"Prompts of {LONG_PROMPT // 1000} k tokens or more: "
        + ", ".join(
            f"{gpu} {n} row{'s' if n > 1 else ''}"
            if n
            else f"{gpu} none (no public measurement found)"
            for gpu, n in long_context_rows().items()
        )
        + ".",
        "",
        "| id | setup | unit | measured | model | model/measured | role | within | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = table_rows()
    for r in rows:
        lines.append(
            f"| {r['id']} | {r['setup']} | {r['unit']} | {r['measured']} | {r['model']} | "
            f"{r['ratio']} | {r['role']} | {r['within']} | {r['source']} |"
        )
    outside = [r for r in rows if r["within"] == "no"]
    if outside:
        lines += ["", "Rows outside ±15 %:", ""]
        lines += [f"- **{r['id']}** ({r['ratio']}): {r['why'] or 'not explained'}" for r in outside]
    return "\n".join(lines) + "\n"
