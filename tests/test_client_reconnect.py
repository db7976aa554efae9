"""The feed's reconnect budget: a backend that is gone ends the feed, drops hours apart never do.

A fake `connect` and a fake clock stand in for the websocket and the 30 s: nothing sleeps.
"""

from __future__ import annotations

import orjson
import pytest

from kvscope.backend.events.state import RunState
from kvscope.frontend import client
from kvscope.frontend.client import HEALTHY_S, Backend, RunFeed

SNAPSHOT = orjson.dumps({"type": "snapshot", **RunState().snapshot()})


class FakeBackend:
    """Each connection delivers a snapshot, stays up `lifetimes[i]` seconds of the fake clock, then drops;
    once the lifetimes run out the backend is gone and every connect fails."""

    def __init__(self, lifetimes: list[float]) -> None:
        self.lifetimes = list(lifetimes)
        self.now = 0.0
        self.connects = 0

    def clock(self) -> float:
        return self.now

    def connect(self, url: str, **_) -> FakeBackend:
        self.connects += 1
        return self

    async def __aenter__(self) -> FakeBackend:
        if not self.lifetimes:
            raise ConnectionRefusedError("the backend is gone")
        return self

    async def __aexit__(self, *_) -> None:
        return None

    async def __aiter__(self):
        yield SNAPSHOT
        self.now += self.lifetimes.pop(0)
        raise ConnectionResetError("dropped")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    fake = FakeBackend([])
    monkeypatch.setattr(client, "connect", fake.connect)
    monkeypatch.setattr(client, "RECONNECT_DELAYS_S", (0.0,) * len(client.RECONNECT_DELAYS_S))
    return fake


def feed_on(fake: FakeBackend) -> RunFeed:
    feed = RunFeed(Backend("http://backend"), "r1")
    feed.clock = fake.clock
    return feed


async def test_drops_after_healthy_connections_never_use_up_the_budget(fake: FakeBackend) -> None:
    drops = 3 * len(client.RECONNECT_DELAYS_S)
    fake.lifetimes = [HEALTHY_S + 1.0] * drops
    feed = feed_on(fake)
    await feed.run()
    # every drop was retried, and the last one's retries at the vanished backend were the whole budget
    assert fake.connects == drops + len(client.RECONNECT_DELAYS_S)
    assert feed.status.startswith("disconnected")


async def test_short_lived_connections_use_up_the_budget(fake: FakeBackend) -> None:
    fake.lifetimes = [HEALTHY_S - 1.0] * (3 * len(client.RECONNECT_DELAYS_S))
    feed = feed_on(fake)
    await feed.run()
    assert fake.connects == 1 + len(client.RECONNECT_DELAYS_S)  # a flapping backend ends the feed as before
    assert feed.status.startswith("disconnected")


async def test_a_backend_gone_from_the_start_ends_the_feed_after_the_budget(fake: FakeBackend) -> None:
    feed = feed_on(fake)
    await feed.run()
    assert fake.connects == 1 + len(client.RECONNECT_DELAYS_S)
    assert feed.status.startswith("disconnected") and feed.state is None
