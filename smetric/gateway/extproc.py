"""One ``ext_proc`` stream per HTTP request: hold the request until its body is whole,
pick, let the body go on; then pass the response through, charging it to its engine.

Envoy sends the request headers, then the body: whole, once the headers are answered
(``BUFFERED``, the shipped configuration), or in pieces as they arrive
(``FULL_DUPLEX_STREAMED``), then trailers if any. A whole body is answered with the pick
(the engine named in a header and in the dynamic metadata, which Envoy applies to the
headers it held) and no copy of it: Envoy forwards its own. A streamed one is held until
it is whole; then the headers are answered with the pick and every piece is echoed, since
Envoy forwards only what comes back. A request the engines should not see gets an
``ImmediateResponse`` instead, and the stream ends. The response's pieces are answered as
they arrive (echoed when Envoy streams them full duplex), so streaming tokens are not held
back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from smetric.core.headers import ENGINE_HEADER, PREDICTED_HIT_HEADER
from smetric.gateway import protocol
from smetric.gateway.picker import Pick, Picker
from smetric.serve.buffered import Hold
from smetric.serve.limits import inflated_bound
from smetric.serve.refusals import Refusal
from smetric.serve.token_count import TOKEN_COUNT_HEADER, declined

Replies = list[ext_proc.ProcessingResponse]


class Exchange:
    """The state of one request's stream: what has arrived, and its pick once made."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body: list[bytes] = []
        self.size = 0
        # The body's bytes in the router-wide budget, from its headers until the pick.
        self.hold = Hold(picker.router.buffered)
        self.pick: Pick | None = None
        self.modes = protocol.Modes()
        self.refused = False
        # The picker answered the client itself (a refusal, a token count): the stream
        # is over.
        self.answered = False

    async def on(self, message: ext_proc.ProcessingRequest) -> Replies:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):  # the stream's first message
            self.modes = protocol.modes(message.protocol_config)
        if kind == "request_headers":
            self.headers = protocol.header_map(message.request_headers.headers)
            self.subset = protocol.subset_hint(message.metadata_context)
            try:  # before the body is held: a client without a key costs no buffering
                self.picker.authorize(self.headers)
                length = self.headers.get("content-length", "")
                await self._hold(int(length) if length.isdigit() else 0)
            except Refusal as refusal:
                return self._refuse(refusal)
            if message.request_headers.end_of_stream:
                return await self._decide([], end_of_stream=True, with_body=False)
            if self.modes.whole_request:  # Envoy sends the body once this is answered
                return [protocol.continue_headers("request", {})]
            return []
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            replies = [] if self.pick else await self._decide(self.body, end_of_stream=False)
            return [*replies, protocol.continue_trailers("request")]
        if kind == "response_headers":
            return await self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            self.close(complete=True)
            return [protocol.continue_trailers("response")]
        return []

    async def _request_body(self, body: ext_proc.HttpBody) -> Replies:
        piece = body.body  # each read of a bytes field copies it: read it once
        if self.pick is not None:  # the body came whole before: nothing more to hold
            return protocol.body_chunks("request", [piece], body.end_of_stream)
        try:
            await self._hold(self.size + len(piece))
        except Refusal as refusal:
            return self._refuse(refusal)
        self.body.append(piece)
        self.size += len(piece)
        if self.modes.whole_request or body.end_of_stream:  # whole: trailers may follow
            return await self._decide(self.body, end_of_stream=True)
        return []

    async def _hold(self, size: int) -> None:
        """Room for ``size`` bytes of body, as ``serve`` holds them: a 413 past the
        per-request limit, a 503 (after a wait) past the router-wide one."""
        self.picker.check_size(size)
        await self.hold.grow(size)

    async def _decide(
        self, pieces: list[bytes], end_of_stream: bool, with_body: bool = True
    ) -> Replies:
        try:
            if self.headers.get("content-encoding"):  # the most it may inflate to
                limit = self.picker.router.settings.max_body_bytes
                await self.hold.grow(inflated_bound(self.size, limit))
            pick = await self.picker.pick(
                self.headers.get(":path", "/"), self.headers, b"".join(pieces), self.subset
            )
        except Refusal as refusal:
            return self._refuse(refusal)
        self.pick = pick
        self.body = []
        # The body goes on with these replies; only a token count's stays.
        self.hold.shrink(len(pick.count_body or b""))
        headers = {protocol.DESTINATION: pick.endpoint}
        removed: tuple[str, ...] = ()
        if pick.body is not None:  # rewritten: it goes as plain JSON of its new length
            pieces = [pick.body]
            headers["content-length"] = str(len(pick.body))
            removed = ("content-encoding",)
        # An engine that requires a key gets its own, in place of the client's.
        auth = self.picker.router.pool.auth(pick.engine)
        if auth:
            headers |= {name.lower(): value for name, value in auth.items()}
            removed += ("x-api-key",)
        if with_body and self.modes.whole_request:
            return [protocol.continue_body("request", headers, pick.endpoint, removed, pick.body)]
        replies = [protocol.continue_headers("request", headers, pick.endpoint, removed)]
        if with_body and (pieces or end_of_stream):
            replies += protocol.body_chunks("request", pieces, end_of_stream)
        return replies

    def _refuse(self, refusal: Refusal) -> Replies:
        self.refused = self.answered = True
        body = self.picker.refused(self.headers.get(":path", "/"), refusal)
        retry = refusal.retry_after_s
        headers = {} if retry is None else {"retry-after": str(retry)}
        return [protocol.immediate(refusal.status, body, headers)]

    async def _response_headers(self, message: ext_proc.ProcessingRequest) -> Replies:
        headers = protocol.header_map(message.response_headers.headers)
        tags: dict[str, str] = {}
        if self.pick is not None:
            served = protocol.served_endpoint(message.metadata_context, headers)
            status = int(headers.get(":status", "0") or 0)
            lost = protocol.connection_failed(headers)
            self.picker.served(self.pick, served, status, lost, protocol.retried(headers))
            if self.pick.count_body is not None:
                if declined(status):
                    return await self._count_here(self.pick.count_body)
                tags[TOKEN_COUNT_HEADER] = "engine"
            tags[ENGINE_HEADER] = self.pick.engine.url
            if self.pick.facts is not None:
                tags[PREDICTED_HIT_HEADER] = str(self.pick.predicted)
            if message.response_headers.end_of_stream:
                self.close(complete=True)
        return [protocol.continue_headers("response", tags, removed=(protocol.UPSTREAM_FAILURE,))]

    async def _count_here(self, raw: bytes) -> Replies:
        """The engine does not serve token counts: the router counts, in its place."""
        self.close(complete=True)
        try:
            count = await self.picker.router.token_counter.count(self.headers, raw)
        except Refusal as refusal:
            return self._refuse(refusal)
        self.answered = True
        return [protocol.immediate(200, count, {TOKEN_COUNT_HEADER: "router"})]

    def _response_body(self, body: ext_proc.HttpBody) -> Replies:
        """Once per chunk of a streamed reply: a token, or a few."""
        piece = body.body
        if self.pick is not None:
            self.picker.streamed(self.pick, piece)
            if body.end_of_stream:
                self.close(complete=True)
        if self.modes.echo_response:
            return protocol.body_chunks("response", [piece], body.end_of_stream)
        return [protocol.CONTINUE_RESPONSE_BODY]

    def close(self, complete: bool) -> None:
        """The exchange is over: the response ended, or the stream did (client gone,
        engine failed, Envoy reset it). Load and held bytes come off here, once."""
        self.hold.shrink(0)
        if self.pick is not None:
            self.picker.finished(self.pick, complete)


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """Envoy's ``ext_proc`` service: one ``Exchange`` per stream."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for message in request_iterator:
                for reply in await exchange.on(message):
                    yield reply
                if exchange.answered:
                    return
        finally:
            exchange.close(complete=False)
