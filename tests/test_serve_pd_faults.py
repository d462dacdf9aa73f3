"""The disaggregated router under engine faults and client hang-ups on either leg, over real
HTTP on loopback: misbehaving engines (``smetric.testing.faulty``) beside mock prefill and
decode engines, clients that give up or reset, and a decode engine killed mid-stream. Every
exit must leave no load on any engine, and answer with the error the colocated path gives."""

from __future__ import annotations

import asyncio
import json
from typing import Literal, TypedDict

import aiohttp
import pytest
from aiohttp import web
from test_serve import conversation
from test_serve_faults import Timeouts, reset
from test_serve_pd import DECODE_HEADER, PREFILL_HEADER, Cluster, fake_engine, with_pd

from smetric.serve.app import Router
from smetric.testing.engines import metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.faulty import Fault

from conftest import eventually

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

# Patient enough for a mock engine on a busy machine, quick to give up on a silent one.
QUICK: Timeouts = {"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0, "connect_timeout_s": 1.0}
# A decode engine that generates in real time: a long answer takes seconds.
SLOW_DECODE = {"speed": 1.0}


Leg = Literal["prefill", "decode"]


class Legs(TypedDict, total=False):
    """``with_pd``'s engines on each leg: misbehaving ones, then healthy mock ones."""

    prefill_faults: tuple[Fault, ...]
    decode_faults: tuple[Fault, ...]
    prefill: int
    decode: int


def faulty_leg(leg: Leg, fault: Fault, healthy: int) -> Legs:
    """One engine with ``fault`` on ``leg``, before ``healthy`` mock ones."""
    if leg == "prefill":
        return {"prefill_faults": (fault,), "prefill": healthy}
    return {"decode_faults": (fault,), "decode": healthy}


class Turns(TypedDict):
    """Round robin on both legs, over one healthy engine on each."""

    policy: str
    decode_policy: str
    prefill: int
    decode: int


def payload(session: int, **extra) -> dict:
    return {"model": "m", "messages": conversation(session, 0), "max_tokens": 4, **extra}


async def no_load_left(client: aiohttp.ClientSession, url: str, router: Router) -> None:
    """Every engine's in-flight requests, prompt tokens and unprefilled tokens are back to
    zero, in the router's counters and in the gauges it exports."""

    def settled() -> bool:
        return all(
            (e.inflight, e.inflight_tokens, e.unprefilled) == (0, 0, 0) for e in router.engines
        )

    await eventually(settled, timeout_s=10)
    async with client.get(url + "/metrics") as response:
        text = await response.text()
    for engine in router.engines:
        assert metric(text, "smetric_engine_inflight_requests", engine=engine.url) == 0
        assert metric(text, "smetric_engine_unprefilled_tokens", engine=engine.url) == 0


async def stream_events(response: aiohttp.ClientResponse) -> tuple[list[str], str]:
    text = (await response.read()).decode()
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")], text


# What a lone misbehaving engine on one leg gets the client: (status, error type). A
# stream that had started ends with an error event instead (status 200).
LONE_FAULTS: list[tuple[Leg, Fault, int]] = [
    ("prefill", "stall", 504),  # nothing before the first-byte timeout
    ("prefill", "stall_mid_stream", 504),  # its body stops: the idle timeout
    ("prefill", "http_500", 500),  # the engine's own JSON error, passed on
    ("prefill", "garbage", 502),
    ("prefill", "truncated_json", 502),
    ("prefill", "text_413", 413),  # the request's fault, as JSON
    ("decode", "stall", 504),
    ("decode", "http_500", 500),
    ("decode", "garbage", 502),
    ("decode", "truncated_json", 502),
    ("decode", "text_413", 413),
    ("decode", "stall_mid_stream", 200),
    ("decode", "broken_stream", 200),
]


@pytest.mark.parametrize(("leg", "fault", "status"), LONE_FAULTS)
def test_a_lone_misbehaving_engine_on_either_leg_answers_like_a_colocated_one(
    leg: Leg, fault: Fault, status: int
) -> None:
    async def body(client, url, router, cluster: Cluster) -> None:
        async with client.post(url + "/v1/chat/completions", json=payload(0)) as response:
            assert response.status == status, await response.text()
            if status == 200:  # the decode's stream had begun: an error event ends it
                events, text = await stream_events(response)
                assert "hi" in events[0]
                error = json.loads(events[-1])["error"]
                assert "[DONE]" not in text
            else:
                assert response.content_type == "application/json"
                error = (await response.json())["error"]
                assert error["code"] == status and error["message"]
        if status != 500:  # a 500 is the engine's own error object, passed on as it is
            kind = "invalid_request_error" if status == 413 else "server_error"
            assert error["type"] == kind
        await no_load_left(client, url, router)
        (fake,) = cluster.fakes.values()
        assert fake.generations == 1
        bad = next(e for e in router.engines if e.url == fake.url)
        # A lost connection ejects at once, a 4xx is no fault, anything else counts one.
        assert bad.healthy == (fault not in ("truncated_json", "broken_stream"))

    asyncio.run(with_pd(body, **faulty_leg(leg, fault, 0), **QUICK))


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("fault", ["http_500", "garbage", "stall"])
def test_a_failing_engine_on_either_leg_is_ejected_and_its_requests_retried(
    leg: Leg, fault: Fault
) -> None:
    async def body(client, url, router, cluster: Cluster) -> None:
        (fake,) = cluster.fakes.values()
        bad = next(e for e in router.engines if e.url == fake.url)
        for session in range(12):
            async with client.post(url + "/v1/chat/completions", json=payload(session)) as r:
                assert r.status == 200, await r.text()
                served_by = r.headers[PREFILL_HEADER if leg == "prefill" else DECODE_HEADER]
                assert served_by in cluster.servers
            if not bad.healthy:
                break
        assert not bad.healthy  # ejected although its /health answers 200...
        await asyncio.sleep(0.3)
        assert not bad.healthy  # ...and kept out by the backoff
        assert fake.generations == 3  # the failures in a row it took
        assert all(e.healthy for e in router.engines if e is not bad)
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        kind = {"http_500": "status", "garbage": "protocol", "stall": "timeout"}[fault]
        assert metric(text, "smetric_engine_failures_total", engine=bad.url, kind=kind) == 3
        assert metric(text, "smetric_retries_total") == 3
        await no_load_left(client, url, router)

    # Round robin on the faulty engine's leg, so it keeps getting its turn until ejected.
    asyncio.run(
        with_pd(
            body,
            **faulty_leg(leg, fault, 1),
            policy="round_robin",
            decode_policy="round_robin",
            health_interval_s=0.05,  # checks pass, yet the backoff keeps it out
            **QUICK,
        )
    )


def test_a_prefill_answering_200_without_json_is_the_engine_s_fault() -> None:
    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="prefilled, I think")

    async def body(client, url, router, cluster: Cluster) -> None:
        bad = router.engines[0]
        async with client.post(url + "/v1/chat/completions", json=payload(0)) as response:
            assert response.status == 200, await response.text()
            assert response.headers[PREFILL_HEADER] != bad.url
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert metric(text, "smetric_engine_failures_total", engine=bad.url, kind="protocol") == 1
        await no_load_left(client, url, router)

    asyncio.run(
        with_pd(
            body, prefill=1, prefill_apps=(lambda: fake_engine(not_json),), policy="round_robin"
        )
    )


def test_retries_are_spent_per_leg_and_refused_connections_spend_none() -> None:
    """Round robin sends each leg's first try to the engine listed first: a misbehaving
    or a dead one."""

    async def one_retry_each(client, url, router, cluster: Cluster) -> None:
        async with client.post(url + "/v1/chat/completions", json=payload(0)) as response:
            assert response.status == 200, await response.text()
        assert [f.generations for f in cluster.fakes.values()] == [1, 1]
        await no_load_left(client, url, router)

    async def none_left(client, url, router, cluster: Cluster) -> None:
        async with client.post(url + "/v1/chat/completions", json=payload(0)) as response:
            assert response.status == 500, await response.text()  # the engine's own error
        assert [f.generations for f in cluster.fakes.values()] == [1]
        await no_load_left(client, url, router)

    turns: Turns = {
        "policy": "round_robin",
        "decode_policy": "round_robin",
        "prefill": 1,
        "decode": 1,
    }
    faulty: tuple[Fault, ...] = ("http_500",)
    asyncio.run(
        with_pd(one_retry_each, prefill_faults=faulty, decode_faults=faulty, **turns, retries=1)
    )
    asyncio.run(with_pd(none_left, prefill_faults=("http_500",), **turns, retries=0))

    async def refused(client, url, router, cluster: Cluster) -> None:
        dead = [e for e in router.engines if e.url not in cluster.servers]
        for engine in dead:
            engine.healthy = True  # as before the health check found them down
        async with client.post(url + "/v1/chat/completions", json=payload(1)) as response:
            assert response.status == 200, await response.text()
        assert not any(e.healthy for e in dead)  # each leg tried its dead engine first
        await no_load_left(client, url, router)

    asyncio.run(with_pd(refused, dead_prefill=1, dead_decode=1, **turns, retries=0))


def test_a_client_giving_up_during_either_leg_leaves_no_load_and_blames_no_engine() -> None:
    """During the prefill (a prefill engine that never answers) and before a long
    non-streamed decode's headers: the router's handler is cancelled mid-leg."""

    async def body(client, url, router, cluster: Cluster) -> None:
        quick = aiohttp.ClientTimeout(total=0.5)
        for session in range(4):
            extra = {"max_tokens": 5000}
            with pytest.raises(TimeoutError):
                async with client.post(
                    url + "/v1/chat/completions", json=payload(session, **extra), timeout=quick
                ) as response:
                    await response.read()
        await no_load_left(client, url, router)
        assert all(e.healthy for e in router.engines)  # a client's impatience is no fault
        async with client.get(url + "/metrics") as response:
            assert "smetric_engine_failures_total{" not in await response.text()

    patient: Timeouts = {"first_byte_timeout_s": 30, "idle_timeout_s": 30}
    prefill_faults: list[tuple[Fault, ...]] = [("stall",), ()]
    for faults in prefill_faults:
        asyncio.run(
            with_pd(
                body,
                prefill=1 - len(faults),
                prefill_faults=faults,
                decode=1,
                decode_config=SLOW_DECODE,
                connect_timeout_s=1,  # the stalled engine does not answer the first scrape
                **patient,
            )
        )


def test_clients_resetting_mid_stream_never_eject_the_decode_engine() -> None:
    async def body(client, url, router, cluster: Cluster) -> None:
        for session in range(4):
            response = await client.post(
                url + "/v1/chat/completions", json=payload(session, max_tokens=5000, stream=True)
            )
            assert response.status == 200, await response.text()
            await response.content.readline()
            reset(response)
        await no_load_left(client, url, router)
        await asyncio.sleep(0.2)  # writes to the gone clients have failed by now
        assert all(e.healthy for e in router.engines)
        # The router hung up on the decode engines too, so they stopped generating.
        for engine in router.engines:
            async with client.get(engine.url + "/metrics") as response:
                assert metric(await response.text(), "vllm:num_requests_running") == 0

    # Without handler cancellation (as under gunicorn), the router's next write to the
    # client is what finds it gone.
    asyncio.run(
        with_pd(body, prefill=1, decode=2, decode_config=SLOW_DECODE, handler_cancellation=False)
    )


def test_a_decode_engine_killed_mid_stream_ends_it_with_an_error_and_is_ejected(
    tmp_path,
) -> None:
    killed = SmetricProcess(tmp_path, args=("engine", "--role", "decode", "--speed", "1.0"))
    victim = ""

    async def body(client, url, router, cluster: Cluster) -> None:
        engine = next(e for e in router.engines if e.url == victim)
        long = payload(0, max_tokens=5000, stream=True)
        async with client.post(url + "/v1/chat/completions", json=long) as response:
            assert response.status == 200 and response.headers[DECODE_HEADER] == victim
            await response.content.readline()
            killed.kill()
            events, text = await stream_events(response)
        assert json.loads(events[-1])["error"]["type"] == "server_error"
        assert "[DONE]" not in text
        assert not engine.healthy  # a cut connection ejects at once
        await no_load_left(client, url, router)
        async with client.post(url + "/v1/chat/completions", json=payload(1)) as response:
            assert response.status == 200, await response.text()
            assert response.headers[DECODE_HEADER] != victim

    try:
        killed.start()
        killed.wait_ready(60.0)
        victim = killed.url
        # Round robin: the first decode goes to the engine listed first, the victim.
        asyncio.run(
            with_pd(body, prefill=1, decode=1, decode_urls=(victim,), decode_policy="round_robin")
        )
    finally:
        killed.stop()
