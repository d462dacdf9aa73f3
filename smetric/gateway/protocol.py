"""The endpoint-picker protocol's messages, built and read without any I/O.

What the Gateway API Inference Extension's protocol (its proposal 004) asks of a picker, as
Envoy's ``ext_proc`` messages:

- the picked engine goes in the request header ``x-gateway-destination-endpoint`` and,
  with the same value, in the dynamic metadata ``envoy.lb``, as ``ip:port``;
- the gateway may limit the choice to ``x-gateway-destination-endpoint-subset`` in the
  filter metadata ``envoy.lb.subset_hint``;
- the endpoint that served the request comes back as ``x-gateway-destination-endpoint-served``
  in the metadata ``envoy.lb`` (or, from a plain Envoy, as a response header);
- a refusal is an ``ImmediateResponse``: 503 when no engine is ready, 429 to shed load.

How bodies travel is the gateway's choice (``Modes``, from the stream's first message): a
``BUFFERED`` request body comes whole, after the headers' answer, and Envoy forwards its own
copy, so the pick goes in the body's answer (Envoy holds the headers until then); a
``FULL_DUPLEX_STREAMED`` body comes in pieces and Envoy forwards only what the picker sends
back (``streamed_response``), so every piece must be echoed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
UPSTREAM_FAILURE = "x-gateway-upstream-failure"
"""Envoy's response flags on its own answer about an upstream (the shipped config adds
this header to those local replies), e.g. ``URX,UF``; not part of the protocol."""
ATTEMPTS = "x-envoy-attempt-count"
"""How many times Envoy sent the request upstream (the shipped config adds it to every
response); not part of the protocol."""
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"

Phase = Literal["request", "response"]


@dataclass(frozen=True)
class Modes:
    """How Envoy sends one stream's bodies, as its first message says
    (``protocol_config``); a stream that does not say (an Envoy before 1.34) is taken to
    stream both ways, full duplex."""

    # BUFFERED: the request body comes in one message, once the headers are answered.
    whole_request: bool = False
    # FULL_DUPLEX_STREAMED: the response goes on only as the picker sends it back.
    echo_response: bool = True


def modes(config: ext_proc.ProtocolConfiguration) -> Modes:
    return Modes(
        whole_request=config.request_body_mode == ProcessingMode.BUFFERED,
        echo_response=config.response_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED,
    )


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-cased names to values; Envoy sends values as ``raw_value`` bytes."""
    return {
        h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
        for h in headers.headers
    }


def _metadata_value(
    metadata: base_pb2.Metadata, namespace: str, key: str
) -> struct_pb2.Value | None:
    fields = metadata.filter_metadata.get(namespace)
    if fields is None or key not in fields.fields:
        return None
    return fields.fields[key]


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the gateway lets the picker choose from (None: any). The protocol
    gives a list; a comma-separated string (what Envoy's header-to-metadata filter makes
    from a header) is read as one too."""
    value = _metadata_value(metadata, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(metadata: base_pb2.Metadata, headers: Mapping[str, str]) -> str | None:
    """The endpoint that served the response: the metadata the protocol defines, else the
    response header of the same name (a plain Envoy adds it with ``%UPSTREAM_REMOTE_ADDRESS%``)."""
    value = _metadata_value(metadata, LB_NAMESPACE, SERVED)
    text = value.string_value if value is not None else headers.get(SERVED, "")
    return text.split(",")[0].strip() or None


def connection_failed(headers: Mapping[str, str]) -> bool:
    """Whether Envoy answered itself because it could not connect to the engine, or lost
    the connection before the headers (flags ``UF``, ``UC``): the engine is gone."""
    flags = set(headers.get(UPSTREAM_FAILURE, "").split(","))
    return bool(flags & {"UF", "UC"})


def retried(headers: Mapping[str, str]) -> bool:
    """Whether Envoy sent the request upstream more than once before this response: the
    shipped config retries only an engine that could not be reached or reset the
    connection before answering."""
    attempts = headers.get(ATTEMPTS, "")
    return attempts.isdigit() and int(attempts) > 1


def _header_mutation(
    headers: Mapping[str, str], removed: Iterable[str] = ()
) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        remove_headers=list(removed),
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for key, value in headers.items()
        ],
    )


def _common(
    headers: Mapping[str, str], removed: Iterable[str], destination: str | None, body: bytes | None
) -> ext_proc.CommonResponse:
    common = ext_proc.CommonResponse(header_mutation=_header_mutation(headers, removed))
    if destination is not None:
        # A gateway may route on the destination header: it must see the one just set.
        common.clear_route_cache = True
    if body is not None:
        common.body_mutation.body = body
    return common


def _reply(
    field: str, response: ext_proc.HeadersResponse | ext_proc.BodyResponse, destination: str | None
) -> ext_proc.ProcessingResponse:
    reply = ext_proc.ProcessingResponse(**{field: response})
    if destination is not None:
        reply.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
    return reply


def continue_headers(
    phase: Phase,
    headers: Mapping[str, str],
    destination: str | None = None,
    removed: Iterable[str] = (),
) -> ext_proc.ProcessingResponse:
    """Let the headers through with ``headers`` set on them and ``removed`` gone; on the
    request, name the ``destination`` in the header and the ``envoy.lb`` metadata alike."""
    common = _common(headers, removed, destination, None)
    return _reply(f"{phase}_headers", ext_proc.HeadersResponse(response=common), destination)


def continue_body(
    phase: Phase,
    headers: Mapping[str, str] | None = None,
    destination: str | None = None,
    removed: Iterable[str] = (),
    body: bytes | None = None,
) -> ext_proc.ProcessingResponse:
    """Let a body Envoy holds go on as it is, or as ``body``; for a whole (``BUFFERED``)
    request, whose headers Envoy holds until this answer, with ``headers``, ``removed``
    and the ``destination`` as ``continue_headers`` applies them."""
    common = _common(headers or {}, removed, destination, body)
    return _reply(f"{phase}_body", ext_proc.BodyResponse(response=common), destination)


CONTINUE_RESPONSE_BODY = ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())
"""The answer to a piece of a response Envoy holds (not full duplex): let it go on as it
is. Built once and never changed: one is sent for every chunk of a streamed reply."""


def body_chunks(
    phase: Phase, chunks: Iterable[bytes], end_of_stream: bool
) -> list[ext_proc.ProcessingResponse]:
    """The body pieces sent back unchanged; the last one ends the stream if ``end_of_stream``
    (not when trailers follow)."""
    pieces = list(chunks) or [b""]
    return [
        ext_proc.ProcessingResponse(
            **{
                f"{phase}_body": ext_proc.BodyResponse(
                    response=ext_proc.CommonResponse(
                        body_mutation=ext_proc.BodyMutation(
                            streamed_response=ext_proc.StreamedBodyResponse(
                                body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1
                            )
                        )
                    )
                )
            }
        )
        for i, piece in enumerate(pieces)
    ]


def continue_trailers(phase: Phase) -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(**{f"{phase}_trailers": ext_proc.TrailersResponse()})


def immediate(
    status: int, body: dict, headers: Mapping[str, str] | None = None
) -> ext_proc.ProcessingResponse:
    """Answer the client directly with a JSON body (an error, or an answer the picker
    has itself), with ``headers`` besides its content type."""
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_header_mutation({"content-type": "application/json", **(headers or {})}),
            body=json.dumps(body).encode(),
            details=f"smetric_pick_{status}",
        )
    )
