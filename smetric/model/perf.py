"""Analytic step-time model of a vLLM-V1-like engine, and the KV-cache budget it leaves.

The simulator calls ``StepTimeModel.step_time`` once per simulated engine step, 10^5-10^6
times a run, so everything that does not depend on the step's contents is folded into
per-token and per-step constants in ``__init__`` and a call is a dozen float operations.

Kernels of one layer run one after another on the same GPUs (vLLM overlaps no two
batches), so each kernel class is bound by its own resource: the step time is the *sum*
over terms of each term's own roofline ``max(compute time, memory time)``, not one max
over the step. Hardware and model numbers are presets (``presets/*.toml``), not code; the
per-term ``Corrections`` let a measured run rescale any term without touching them.
Checked against public measurements, fitted rows apart from held-out ones, by
``smetric fidelity`` (the anchors: ``presets/anchors.toml``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from smetric.core.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
# What an FP8 checkpoint keeps in BF16 (embedding, lm_head, routers) is stored at this width;
# a checkpoint served at a wider dtype (float32 on a CPU) keeps them at its own.
_UNQUANTIZED_BYTES = 2
# Activations cross the tensor-parallel all-reduces in BF16.
_ACTIVATION_BYTES = 2
# load_model() rejects a preset whose published parameter counts its shape misses by more.
_PARAM_TOLERANCE = 0.02

# A preset field that the named thing sets, never a preset file's table (read by
# ``smetric model --preset-file``): a file that renamed a preset or changed its GPU count
# would describe some other machine under its name.
NAMED_BY_PRESET = {"chosen_by": "the preset's name"}
COUNTED_BY_FLAG = {"chosen_by": "--gpus"}


@cache
def _presets(filename: str) -> dict[str, dict[str, Any]]:
    text = resources.files("smetric.model").joinpath("presets", filename).read_text("utf-8")
    return tomllib.loads(text)


HARDWARE_NAMES: tuple[str, ...] = tuple(_presets("hardware.toml"))
MODEL_NAMES: tuple[str, ...] = tuple(_presets("models.toml"))
MEDIUM_NAMES: tuple[str, ...] = tuple(_presets("tiers.toml"))


def _dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        ) from None


def _unquantized_bytes(weight_bytes: int) -> int:
    return max(weight_bytes, _UNQUANTIZED_BYTES)


@dataclass(frozen=True)
class Hardware:
    """One instance's GPUs: per-GPU peaks and achieved fractions, times ``gpus``.

    Efficiencies are what real kernels reach of a peak, measured on that GPU family; a
    term's time is its work over ``peak x efficiency``. A tensor-parallel instance is
    worth ``gpus x tp_efficiency`` single GPUs and pays two all-reduces per layer.
    ``memory_mib`` is what the device reports (nvidia-smi, ``torch.cuda.mem_get_info``),
    the figure vLLM sizes its pool from. The overheads and the profiled activation bytes
    are fitted per GPU on measured engines (the presets say which).
    """

    name: str = field(metadata=NAMED_BY_PRESET)
    gpus: int = field(metadata=COUNTED_BY_FLAG)
    bf16_tflops: float
    fp8_tflops: float
    hbm_tb_s: float
    memory_mib: float
    gemm_efficiency: float
    grouped_gemm_efficiency: float
    fp8_gemm_derate: float
    attention_efficiency: float
    decode_attention_bw_efficiency: float
    decode_seq_bw_efficiency: float
    memory_efficiency: float
    nvlink_gb_s: float
    allreduce_bw_efficiency: float
    allreduce_latency_s: float
    tp_efficiency: float
    step_overhead_s: float
    layer_overhead_s: float
    activation_bytes_per_token: float
    # False for a CPU stand-in (the real-engine twin's core), which no GPU figure checks.
    gpu: bool = True

    @property
    def scale(self) -> float:
        """How many single GPUs' worth of compute and bandwidth the instance has."""
        return self.gpus * self.tp_efficiency if self.gpus > 1 else 1.0


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen3-MoE-shaped model: GQA attention, top-k routed experts, untied lm_head."""

    name: str = field(metadata=NAMED_BY_PRESET)
    hf_repo: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    tie_embeddings: bool
    total_params: float
    active_matmul_params: float
    weight_dtype: str
    max_context: int
    max_context_yarn: int

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer."""
        return self.hidden * self.head_dim * 2 * (self.q_heads + self.kv_heads)

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def expert_params(self) -> int:
        """gate, up and down projections of one expert in one layer."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def embedding_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    @property
    def dense_params(self) -> int:
        """Matmul weights every token runs through besides its experts and the lm_head."""
        return self.layers * (self.attention_params + self.router_params)

    @property
    def unquantized_params(self) -> int:
        return self.lm_head_params + self.embedding_params + self.layers * self.router_params

    @property
    def shape_total_params(self) -> int:
        per_layer = self.attention_params + self.router_params + self.experts * self.expert_params
        return self.layers * per_layer + self.lm_head_params + self.embedding_params

    @property
    def shape_active_params(self) -> int:
        moe = self.layers * self.top_k * self.expert_params
        return self.dense_params + moe + self.lm_head_params


@dataclass(frozen=True)
class Medium:
    """How one instance's connector moves KV to and from the global tier.

    LMCache's ``start_load_kv`` retrieves a request's chunks from the store before the
    forward pass; end to end that costs a fixed ``setup_s`` (lookup, bookkeeping) plus the
    bytes at ``gb_s``, the rate one connector reaches on the medium, 0 meaning only the
    links' line rates limit it (``presets/tiers.toml`` gives each figure's source).
    """

    name: str
    setup_s: float
    gb_s: float
    source: str

    def seconds(self, nbytes: float, line_rate_gb_s: float) -> float:
        """One transfer alone: setup plus the bytes at the slower of medium and links."""
        rate = min(self.gb_s, line_rate_gb_s) if self.gb_s > 0 else line_rate_gb_s
        return self.setup_s + nbytes / (rate * 1e9)


def load_medium(name: str) -> Medium:
    presets = _presets("tiers.toml")
    if name not in presets:
        raise ConfigError(
            f"unknown global-tier medium {name!r}; presets: {', '.join(MEDIUM_NAMES)}"
        )
    return Medium(name=name, **presets[name])


def load_hardware(name: str, gpus: int = 1) -> Hardware:
    presets = _presets("hardware.toml")
    if name not in presets:
        raise ConfigError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE_NAMES)}")
    if gpus < 1:
        raise ConfigError(f"an instance needs at least one GPU, got {gpus}")
    return Hardware(name=name, gpus=gpus, **presets[name])


def load_model(name: str) -> ModelSpec:
    presets = _presets("models.toml")
    if name not in presets:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(MODEL_NAMES)}")
    spec = ModelSpec(name=name, **presets[name])
    for published, derived in (
        (spec.total_params, spec.shape_total_params),
        (spec.active_matmul_params, spec.shape_active_params),
    ):
        if abs(derived / published - 1) > _PARAM_TOLERANCE:
            raise ValueError(
                f"model preset {name!r}: its shape implies {derived:.3e} parameters where "
                f"{published:.3e} are published"
            )
    _dtype_bytes(spec.weight_dtype)
    return spec


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str) -> int:
    return 2 * model.layers * model.kv_heads * model.head_dim * _dtype_bytes(kv_dtype)


def weight_bytes(model: ModelSpec, weight_dtype: str) -> float:
    quantized = model.total_params - model.unquantized_params
    w = _dtype_bytes(weight_dtype)
    return quantized * w + model.unquantized_params * _unquantized_bytes(w)


def kv_capacity_tokens(
    model: ModelSpec,
    hardware: Hardware,
    *,
    weight_dtype: str,
    kv_dtype: str,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
) -> int:
    """KV tokens one instance holds, as vLLM sizes its pool (0 when the weights do not fit).

    vLLM's worker requests ``gpu_memory_utilization`` x the bytes the device reports
    (``Worker.init_device``: ``requested_memory``), then ``determine_available_memory``
    runs a dummy forward pass of ``max_num_batched_tokens`` tokens (``profile_run``) and
    gives the KV pool what is left of the request after the weights, the torch peak of
    that pass and the memory allocated outside torch. That profiled remainder is
    ``activation_bytes_per_token`` per batched token, per GPU (fitted in the presets).
    """
    usable = hardware.memory_mib * 2**20 * hardware.gpus * gpu_memory_utilization
    profiled = hardware.activation_bytes_per_token * max_num_batched_tokens * hardware.gpus
    free = usable - weight_bytes(model, weight_dtype) - profiled
    return max(0, int(free // kv_bytes_per_token(model, kv_dtype)))


@dataclass(frozen=True)
class Corrections:
    """Per-term factors, to rescale the analytic terms to a measured engine.

    ``compute`` scales the GEMMs' compute-bound times (dense, experts, lm_head), ``memory``
    their weight-streaming times, ``attention`` both prefill attention FLOPs and decode KV
    reads, ``comm`` the tensor-parallel all-reduces, ``prefill`` every compute-bound term
    (GEMM FLOPs and prefill attention) at once: an engine whose prefill runs slower than
    the kernels' measurements say. The overheads are what an engine step costs besides
    its GEMMs and attention: per step, scheduling, input preparation and sampling; per
    layer, the small kernels (norms, RoPE, KV-cache write, routing top-k, expert sort,
    activation). None takes the hardware preset's fitted values.
    """

    compute: float = 1.0
    memory: float = 1.0
    attention: float = 1.0
    step_overhead_s: float | None = None
    layer_overhead_s: float | None = None
    comm: float = 1.0
    prefill: float = 1.0


@dataclass(frozen=True)
class StepBreakdown:
    """The terms of one step, in seconds; they add up to ``step_time``."""

    overhead: float
    dense: float
    lm_head: float
    experts: float
    attention: float
    comm: float

    @property
    def total(self) -> float:
        return self.overhead + self.dense + self.lm_head + self.experts + self.attention + self.comm


class StepTimeModel:
    """Seconds one engine step takes, from what the step computes.

    A step (continuous batching with chunked prefill) runs ``prefill_tokens`` new prompt
    tokens and ``decode_seqs`` decode tokens through the model. Terms:

    - dense GEMMs (attention projections, router): ``2 x dense params x tokens`` FLOPs
      against one read of their weights;
    - lm_head: only for the positions that are sampled (each decode, and one for the
      step's prefill chunks: the last position of a finishing prompt);
    - experts: ``2 x top_k x expert params x tokens`` FLOPs against reading every expert
      the batch touches: ``E (1 - (1 - k/E)^B)`` of ``E`` for ``B`` tokens under uniform
      routing, which is why decode step time grows sublinearly in batch size up to
      B = 32-64;
    - attention: prefill's quadratic part from ``prefill_attn_tokens2`` (query-key pairs:
      ``4 x q_heads x head_dim`` FLOPs each per layer), counted as compute only since a
      chunk reuses each KV read across its rows and the GQA group (memory only wins
      below ~5-token chunks); decode's KV-cache reads, at the HBM rate decode kernels
      reach once enough sequences run (``decode_attention_bw_efficiency``), and at
      ``decode_seq_bw_efficiency`` per sequence below that: one sequence's attention
      cannot fill the GPU;
    - all-reduces of the activations, twice per layer, when the instance spans GPUs;
    - fixed per-step and per-layer overheads (``Corrections``).
    """

    __slots__ = (
        "_comm_fixed_s",
        "_comm_s_per_token",
        "_dense_read_s",
        "_dense_s_per_token",
        "_expert_read_s",
        "_fixed_s",
        "_kv_seqs_to_fill",
        "_kv_token_s",
        "_lm_read_s",
        "_lm_s_per_token",
        "_miss",
        "_moe_s_per_token",
        "_overhead_s",
        "_pair_s",
    )

    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        *,
        weight_dtype: str = "bf16",
        kv_dtype: str = "bf16",
        corrections: Corrections = Corrections(),
    ) -> None:
        c = corrections
        compute = c.compute * c.prefill
        w = _dtype_bytes(weight_dtype)
        fp8 = weight_dtype == "fp8"
        scale = hardware.scale
        peak = (hardware.fp8_tflops if fp8 else hardware.bf16_tflops) * 1e12 * scale
        derate = hardware.fp8_gemm_derate if fp8 else 1.0
        dense_rate = peak * hardware.gemm_efficiency * derate
        moe_rate = peak * hardware.grouped_gemm_efficiency * derate
        bf16_peak = hardware.bf16_tflops * 1e12 * scale
        lm_rate = bf16_peak * hardware.gemm_efficiency
        attn_rate = bf16_peak * hardware.attention_efficiency
        weight_bw = hardware.hbm_tb_s * 1e12 * scale * hardware.memory_efficiency
        kv_bw = hardware.hbm_tb_s * 1e12 * scale * hardware.decode_attention_bw_efficiency
        layers = model.layers

        self._dense_s_per_token = 2 * model.dense_params / dense_rate * compute
        dense_bytes = layers * (
            model.attention_params * w + model.router_params * _unquantized_bytes(w)
        )
        self._dense_read_s = dense_bytes / weight_bw * c.memory
        self._lm_s_per_token = 2 * model.lm_head_params / lm_rate * compute
        self._lm_read_s = model.lm_head_params * _unquantized_bytes(w) / weight_bw * c.memory
        active_expert_params = layers * model.top_k * model.expert_params
        self._moe_s_per_token = 2 * active_expert_params / moe_rate * compute
        all_expert_bytes = layers * model.experts * model.expert_params * w
        self._expert_read_s = all_expert_bytes / weight_bw * c.memory
        self._miss = 1.0 - model.top_k / model.experts
        attn_flops = 4 * model.q_heads * model.head_dim * layers
        self._pair_s = attn_flops / attn_rate * c.attention * c.prefill
        # Decode attention is linear in context for both resources: the larger wins.
        kv_read_s = kv_bytes_per_token(model, kv_dtype) / kv_bw
        self._kv_token_s = max(kv_read_s, attn_flops / attn_rate) * c.attention
        self._kv_seqs_to_fill = (
            hardware.decode_attention_bw_efficiency / hardware.decode_seq_bw_efficiency
        )
        if hardware.gpus > 1:
            # Ring all-reduce moves 2(g-1)/g of the message over each GPU's link.
            g = hardware.gpus
            link = hardware.nvlink_gb_s * 1e9 * hardware.allreduce_bw_efficiency
            per_token = 2 * (g - 1) / g * model.hidden * _ACTIVATION_BYTES / link
            self._comm_fixed_s = 2 * layers * hardware.allreduce_latency_s * c.comm
            self._comm_s_per_token = 2 * layers * per_token * c.comm
        else:
            self._comm_fixed_s = 0.0
            self._comm_s_per_token = 0.0
        step_overhead = hardware.step_overhead_s if c.step_overhead_s is None else c.step_overhead_s
        layer_overhead = (
            hardware.layer_overhead_s if c.layer_overhead_s is None else c.layer_overhead_s
        )
        self._overhead_s = step_overhead + layers * layer_overhead
        self._fixed_s = self._overhead_s + self._comm_fixed_s

    @property
    def kv_token_s(self) -> float:
        """Seconds a decode step spends per token of KV it attends over."""
        return self._kv_token_s

    def step_time(
        self,
        prefill_tokens: int,
        prefill_attn_tokens2: float,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """Seconds for one step; see the class docstring for the arguments' meaning.

        ``prefill_attn_tokens2`` is the sum over prefill chunks of
        ``chunk_len x (tokens already cached or computed before the chunk + chunk_len / 2)``;
        ``decode_context_tokens`` the sum of the decode sequences' KV lengths.
        """
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            raise ValueError("an engine step runs at least one token")
        logits = decode_seqs + (1 if prefill_tokens else 0)
        return (
            self._fixed_s
            + max(tokens * self._dense_s_per_token, self._dense_read_s)
            + max(logits * self._lm_s_per_token, self._lm_read_s)
            + max(tokens * self._moe_s_per_token, (1.0 - self._miss**tokens) * self._expert_read_s)
            + prefill_attn_tokens2 * self._pair_s
            + self._decode_attention(decode_seqs, decode_context_tokens)
            + tokens * self._comm_s_per_token
        )

    def _decode_attention(self, decode_seqs: int, decode_context_tokens: int) -> float:
        if decode_seqs == 0 or decode_seqs >= self._kv_seqs_to_fill:
            return decode_context_tokens * self._kv_token_s
        return decode_context_tokens * self._kv_token_s * self._kv_seqs_to_fill / decode_seqs

    def breakdown(
        self,
        prefill_tokens: int,
        prefill_attn_tokens2: float,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> StepBreakdown:
        """The same step, term by term: which resource a configuration is bound by."""
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            raise ValueError("an engine step runs at least one token")
        logits = decode_seqs + (1 if prefill_tokens else 0)
        return StepBreakdown(
            overhead=self._overhead_s,
            dense=max(tokens * self._dense_s_per_token, self._dense_read_s),
            lm_head=max(logits * self._lm_s_per_token, self._lm_read_s),
            experts=max(
                tokens * self._moe_s_per_token,
                (1.0 - self._miss**tokens) * self._expert_read_s,
            ),
            attention=prefill_attn_tokens2 * self._pair_s
            + self._decode_attention(decode_seqs, decode_context_tokens),
            comm=self._comm_fixed_s + tokens * self._comm_s_per_token,
        )
