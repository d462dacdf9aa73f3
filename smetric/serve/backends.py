"""What the router must know of one kind of engine: the ``EngineBackend`` seam.

Routing, forwarding and the pool are the same for every engine; what differs between
engine kinds is how they speak about themselves and how they hand KV to each other:

- the names of their Prometheus metrics (load, KV pool, generation counters, start time);
- the wire format of their KV events, and how a subscriber reaches them;
- the endpoint that tokenises a prompt exactly;
- where their ``/v1/models`` entries give the context length;
- the disaggregated-serving protocol: what the prefill leg asks for, and what the decode
  leg is given from the prefill's answer.

Each engine carries its backend, chosen per engine in the config (``backend:``, default
``vllm``). vLLM is the one implementation. SGLang would be the second (its own metric
names, ZMQ KV events and PD bootstrap protocol), but its PyPI wheel is CUDA-only, so no
real SGLang engine can run on the CPU machines the tests and CI run on, and a backend
without a real engine to test it against would be a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from smetric.core.errors import ConfigError
from smetric.core.kv_events import EventIndex
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.scrape import EngineReport

KV_TRANSFER_PARAMS = "kv_transfer_params"


def without_client_transfer(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The request as engines may see it: without the client's ``kv_transfer_params``.

    They tell an engine where to read or keep KV (``remote_host``, ``remote_port``, block
    ids), so a client's own would steer the engine to any address it chose; only the
    router's, on the legs it sends a disaggregated request as, reach engines. A body
    without them stays the bytes it came as; one with them is re-encoded without."""
    if KV_TRANSFER_PARAMS not in body:
        return raw, body
    kept = {key: value for key, value in body.items() if key != KV_TRANSFER_PARAMS}
    return msgspec.json.encode(kept), kept


class EngineBackend(Protocol):
    """One kind of engine, as the router sees it."""

    name: str
    # POST path that tokenises ``{"prompt", "add_special_tokens"}`` into ``{"tokens"}``.
    tokenize_path: str

    def parse_metrics(self, text: str, at: float) -> EngineReport:
        """The figures the router uses from the engine's ``/metrics`` text; raises
        ValueError on text that is not the Prometheus format."""
        ...

    def context_length(self, models: list[dict[str, Any]]) -> int:
        """The longest context the engine's ``/v1/models`` entries report (0: none)."""
        ...

    def kv_event_subscriber(
        self, index: EventIndex, spec: Mapping[str, Any], name: str
    ) -> KVEventSubscriber:
        """A subscriber that keeps ``index`` applied to the engine's KV events, from the
        engine's ``kv_events:`` config entry."""
        ...

    def prefill_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg's body for the client's ``body``."""
        ...

    def decode_request(self, body: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
        """The decode leg's body, given the prefill engine's JSON answer."""
        ...

    def handoff(self, prefilled: dict[str, Any]) -> dict[str, Any] | None:
        """What the prefill answer hands the decode side (None: nothing, the decode
        engine finds the KV on its own)."""
        ...


class VLLMBackend:
    """vLLM's OpenAI server: ``vllm:`` metrics, msgpack KV events over ZMQ
    (``--kv-events-config``), ``/tokenize``, ``max_model_len`` in ``/v1/models``, and
    ``kv_transfer_params`` as its disaggregated proxy (``examples/online_serving/
    disaggregated_serving``) and its NIXL connector speak it."""

    name = "vllm"
    tokenize_path = "/tokenize"

    def parse_metrics(self, text: str, at: float) -> EngineReport:
        """Summed over label sets (a data-parallel engine has one per rank)."""
        values: dict[str, float] = {}
        blocks: int | None = None
        block_size: int | None = None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if sample.name == "vllm:cache_config_info":
                    blocks = _int(sample.labels.get("num_gpu_blocks"))
                    block_size = _int(sample.labels.get("block_size"))
        generated = values.get("vllm:generation_tokens_total")
        prompted = values.get("vllm:prompt_tokens_total")
        progress = (
            None
            if generated is None and prompted is None
            else (generated or 0.0) + (prompted or 0.0)
        )
        return EngineReport(
            at=at,
            running=values.get("vllm:num_requests_running"),
            waiting=values.get("vllm:num_requests_waiting"),
            kv_usage=values.get("vllm:kv_cache_usage_perc"),
            num_gpu_blocks=blocks,
            block_size=block_size,
            started_at=values.get("process_start_time_seconds"),
            progress_tokens=progress,
        )

    def context_length(self, models: list[dict[str, Any]]) -> int:
        lengths = [m.get("max_model_len") for m in models]
        return max((n for n in lengths if type(n) is int and n > 0), default=0)

    def kv_event_subscriber(
        self, index: EventIndex, spec: Mapping[str, Any], name: str
    ) -> KVEventSubscriber:
        return KVEventSubscriber(
            index,
            spec["endpoint"],
            topic=str(spec.get("topic", "")),
            replay_endpoint=spec.get("replay_endpoint"),
            bind=spec.get("bind"),
            name=name,
        )

    def prefill_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """One token, not streamed, asking the engine to keep the KV for a remote decode;
        a client's own ``kv_transfer_params`` keys (where the operator lets clients send
        them) are kept beside those."""
        out = {k: v for k, v in body.items() if k != "stream_options"}
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        own = body.get(KV_TRANSFER_PARAMS)
        out[KV_TRANSFER_PARAMS] = {
            **(own if isinstance(own, dict) else {}),
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return out

    def handoff(self, prefilled: dict[str, Any]) -> dict[str, Any] | None:
        params = prefilled.get(KV_TRANSFER_PARAMS)
        return params if isinstance(params, dict) else None

    def decode_request(self, body: dict[str, Any], prefilled: dict[str, Any]) -> dict[str, Any]:
        params = self.handoff(prefilled)
        return body if params is None else {**body, KV_TRANSFER_PARAMS: params}


VLLM = VLLMBackend()
BACKENDS: dict[str, EngineBackend] = {VLLM.name: VLLM}


def backend_named(name: str) -> EngineBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown engine backend {name!r}; one of {', '.join(sorted(BACKENDS))}"
        ) from None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
