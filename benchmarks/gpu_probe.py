"""Measure on one GPU what the performance model assumes, and write it as a hardware preset.

    python benchmarks/gpu_probe.py --base H200 --out h200-probed.toml
    smetric model --hardware H200 --preset-file h200-probed.toml      # use it
    python benchmarks/gpu_probe.py --device cpu --quick --out /tmp/p.toml   # smoke test

Uses only torch. With Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of FFN 768, top 8) it times:

- dense GEMM: the attention projections of an 8,192-token prefill chunk (``gemm_efficiency``);
- grouped GEMM: 8,192 tokens' expert FFNs, 512 rows per expert, as batched matmuls
  (``grouped_gemm_efficiency``);
- prefill attention: one 8,192-token chunk after 0 to 120 k tokens of context, through
  ``scaled_dot_product_attention`` (``attention_efficiency``, fitted on the FLOPs of every
  depth together; the deepest chunks weigh most);
- decode attention: one query token per sequence over its KV, at batch 1 and at a full
  batch (``decode_seq_bw_efficiency``, ``decode_attention_bw_efficiency``);
- weight streaming: reading a tensor larger than any cache (``memory_efficiency``);
- host-to-device copy from pinned memory (the cluster's ``pcie_gb_s``);
- the device's memory as it reports it (``memory_mib``).

Each efficiency is the measured rate over the ``--base`` preset's peak (or ``--peak-tflops``,
``--peak-tb-s``). The output is TOML in the presets' shape: a ``[hardware]`` table with
every field of the base preset, the measured ones replaced, which ``smetric model
--preset-file`` reads as it is and which can be pasted into
``smetric/model/presets/hardware.toml`` as that GPU's table. The fitted per-step overheads
need a serving engine, not kernels, and are kept from the base preset. Timings need a
quiet GPU; each is the median of ``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from smetric.model.perf import load_hardware

# Qwen3-30B-A3B (its Hugging Face config).
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_FFN = 128, 8, 768


@dataclass(frozen=True)
class Shapes:
    chunk: int
    contexts: tuple[int, ...]
    decode_context: int
    decode_batch: int
    stream_bytes: int
    copy_bytes: int

    @classmethod
    def full(cls) -> Shapes:
        return cls(8192, (0, 8192, 24576, 57344, 122880), 32768, 64, 4 << 30, 1 << 30)

    @classmethod
    def quick(cls) -> Shapes:
        """Small enough for a CPU: checks the probe runs and writes its file, nothing more."""
        return cls(256, (0, 256, 768), 1024, 4, 16 << 20, 16 << 20)


@dataclass(frozen=True)
class Measurement:
    """One probe: what it computed or moved, and how long that took (median seconds)."""

    name: str
    seconds: float
    flops: float = 0.0
    nbytes: float = 0.0

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


# -- timing (torch) ------------------------------------------------------------------------


def _timer(device: str) -> Callable[[Callable[[], Any], int], float]:
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
        fn()  # warm-up: kernel selection, allocator
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median_seconds


def measure(device: str, shapes: Shapes, repeats: int) -> list[Measurement]:
    import torch
    import torch.nn.functional as F

    timed = _timer(device)
    # BF16 is what the engines run; CPUs without BF16 units emulate it a thousand times
    # slower, so a CPU smoke test runs in float32.
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out: list[Measurement] = []

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    # Dense GEMM: q, k, v projections fused, then o, for one prefill chunk.
    m = shapes.chunk
    qkv_out = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    x, w_qkv, w_o = rand(m, HIDDEN), rand(HIDDEN, qkv_out), rand(Q_HEADS * HEAD_DIM, HIDDEN)
    a = rand(m, Q_HEADS * HEAD_DIM)
    flops = 2 * m * HIDDEN * qkv_out + 2 * m * Q_HEADS * HEAD_DIM * HIDDEN
    out.append(Measurement("dense_gemm", timed(lambda: (x @ w_qkv, a @ w_o), repeats), flops))

    # Grouped GEMM: each expert's rows (top_k x tokens / experts of them), gate+up then down.
    rows = max(1, m * TOP_K // EXPERTS)
    xe = rand(EXPERTS, rows, HIDDEN)
    w_up, w_down = rand(EXPERTS, HIDDEN, 2 * EXPERT_FFN), rand(EXPERTS, EXPERT_FFN, HIDDEN)
    he = rand(EXPERTS, rows, EXPERT_FFN)
    flops = 2 * EXPERTS * rows * HIDDEN * 3 * EXPERT_FFN
    out.append(
        Measurement(
            "grouped_gemm",
            timed(lambda: (torch.bmm(xe, w_up), torch.bmm(he, w_down)), repeats),
            flops,
        )
    )

    # Prefill attention: a chunk's causal part plus its full attention to the context
    # before it (the time of a fused kernel over both; the outputs are not merged).
    q = rand(1, Q_HEADS, m, HEAD_DIM)
    k_own, v_own = rand(1, KV_HEADS, m, HEAD_DIM), rand(1, KV_HEADS, m, HEAD_DIM)
    for context in shapes.contexts:
        k_ctx = rand(1, KV_HEADS, context, HEAD_DIM) if context else None
        v_ctx = rand(1, KV_HEADS, context, HEAD_DIM) if context else None

        def chunk(k_ctx: Any = k_ctx, v_ctx: Any = v_ctx) -> None:
            F.scaled_dot_product_attention(q, k_own, v_own, is_causal=True, enable_gqa=True)
            if k_ctx is not None:
                F.scaled_dot_product_attention(q, k_ctx, v_ctx, enable_gqa=True)

        pairs = m * (context + m / 2)
        out.append(
            Measurement(
                f"prefill_attention_{context}",
                timed(chunk, repeats),
                4 * Q_HEADS * HEAD_DIM * pairs,
            )
        )

    # Decode attention: one token per sequence over its KV; bytes are the KV read.
    for batch in (1, shapes.decode_batch):
        qd = rand(batch, Q_HEADS, 1, HEAD_DIM)
        kd = rand(batch, KV_HEADS, shapes.decode_context, HEAD_DIM)
        vd = rand(batch, KV_HEADS, shapes.decode_context, HEAD_DIM)
        nbytes = 2 * batch * KV_HEADS * shapes.decode_context * HEAD_DIM * kd.element_size()
        attention = functools.partial(F.scaled_dot_product_attention, qd, kd, vd, enable_gqa=True)
        seconds = timed(attention, repeats)
        out.append(Measurement(f"decode_attention_b{batch}", seconds, nbytes=nbytes))

    # Weight streaming: one read of a tensor far larger than the caches.
    big = torch.ones(shapes.stream_bytes // torch.finfo(dtype).bits * 8, device=device, dtype=dtype)
    seconds = timed(big.sum, repeats)
    out.append(Measurement("stream", seconds, nbytes=shapes.stream_bytes))

    # Host to device, from pinned memory where there is a GPU.
    host = torch.ones(shapes.copy_bytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    out.append(
        Measurement(
            "host_to_device",
            timed(lambda: host.to(device, non_blocking=True), repeats),
            nbytes=shapes.copy_bytes,
        )
    )
    return out


def device_memory_mib(device: str) -> float | None:
    import torch

    if not device.startswith("cuda"):
        return None
    return torch.cuda.mem_get_info(torch.device(device))[1] / 2**20


# -- from measurements to a preset (pure) --------------------------------------------------


def attention_efficiency(points: Mapping[int, Measurement], peak_tflops: float) -> float:
    """One efficiency for every depth: total FLOPs over total time, so the deep chunks,
    which dominate long-context prefill, weigh most."""
    flops = sum(p.flops for p in points.values())
    seconds = sum(p.seconds for p in points.values())
    return flops / seconds / (peak_tflops * 1e12)


def fitted(
    measurements: list[Measurement], base: Mapping[str, Any], memory_mib: float | None
) -> tuple[dict[str, Any], dict[str, float]]:
    """The base preset's fields with the measured ones replaced, and the link figures."""
    by = {m.name: m for m in measurements}
    peak, hbm = base["bf16_tflops"], base["hbm_tb_s"] * 1e3  # TFLOP/s, GB/s
    prefill = {int(n.rsplit("_", 1)[1]): m for n, m in by.items() if n.startswith("prefill_")}
    batches = sorted(int(n.rsplit("b", 1)[1]) for n in by if n.startswith("decode_attention_b"))
    preset = dict(base)
    preset |= {
        "gemm_efficiency": by["dense_gemm"].tflops / peak,
        "grouped_gemm_efficiency": by["grouped_gemm"].tflops / peak,
        "attention_efficiency": attention_efficiency(prefill, peak),
        "decode_seq_bw_efficiency": by[f"decode_attention_b{batches[0]}"].gb_s / hbm,
        "decode_attention_bw_efficiency": by[f"decode_attention_b{batches[-1]}"].gb_s / hbm,
        "memory_efficiency": by["stream"].gb_s / hbm,
    }
    if memory_mib is not None:
        preset["memory_mib"] = round(memory_mib)
    return preset, {"pcie_gb_s": by["host_to_device"].gb_s}


def to_toml(preset: Mapping[str, Any], links: Mapping[str, float], notes: list[str]) -> str:
    """A ``[hardware]`` table (what ``smetric model --preset-file`` reads) and the measured
    link rates as comments (they are cluster settings, not preset fields)."""
    lines = [f"# {note}" for note in notes]
    lines += [
        f"# measured {k} = {v:.4g} (a cluster setting: --config cluster.{k})"
        for k, v in links.items()
    ]
    # Four significant digits: what a probe's median of a few runs can tell apart.
    table = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in preset.items()}
    return "\n".join(lines) + "\n" + tomli_w.dumps({"hardware": table})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--base", default="H200", help="hardware preset to start from")
    parser.add_argument("--peak-tflops", type=float, help="BF16 dense peak [default: base's]")
    parser.add_argument("--peak-tb-s", type=float, help="HBM bandwidth [default: base's]")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--out", type=Path, default=Path("gpu-probe.toml"))
    args = parser.parse_args()

    base = {
        k: v
        for k, v in dataclasses.asdict(load_hardware(args.base)).items()
        if k not in ("name", "gpus")
    }
    if args.peak_tflops:
        base["bf16_tflops"] = args.peak_tflops
    if args.peak_tb_s:
        base["hbm_tb_s"] = args.peak_tb_s
    shapes = Shapes.quick() if args.quick else Shapes.full()
    measurements = measure(args.device, shapes, args.repeats)
    preset, links = fitted(measurements, base, device_memory_mib(args.device))
    for m in measurements:
        rate = f"{m.tflops:8.1f} TFLOP/s" if m.flops else f"{m.gb_s:8.1f} GB/s"
        print(f"{m.name:28s} {m.seconds * 1e3:9.3f} ms  {rate}")
    what = "quick shapes" if args.quick else "Qwen3-30B-A3B shapes"
    notes = [
        f"gpu_probe.py on {args.device} ({what}), base preset {args.base}, "
        f"median of {args.repeats}",
        *(f"{m.name}: {m.seconds * 1e3:.3f} ms" for m in measurements),
    ]
    args.out.write_text(to_toml(preset, links, notes))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
