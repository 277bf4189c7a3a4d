"""Shared fixtures: a real dev broker for the session and the real Redis server.

Neither is mocked (DESIGN §8). The whole suite shares one broker process; tests stay
independent by creating their own topics with names from ``unique_topic`` (note that
Tansu auto-creates an unknown topic on a metadata request, so create topics first).
"""

from __future__ import annotations

import itertools
import socket
import uuid
from collections.abc import Callable, Iterator

import pytest

from streamrec.tools.devbroker import DevBroker

REDIS_HOST = "127.0.0.1"
REDIS_PORT = 6379


@pytest.fixture(scope="session")
def broker() -> Iterator[DevBroker]:
    """A Tansu dev broker on a free 127.0.0.1 port for the whole test session."""
    dev = DevBroker()
    dev.start()
    try:
        yield dev
    finally:
        dev.stop()


@pytest.fixture
def unique_topic() -> Callable[[str], str]:
    """``unique_topic("playback")`` -> a topic name no other test uses."""
    run = uuid.uuid4().hex[:8]
    counter = itertools.count()
    return lambda stem: f"{stem}-{run}-{next(counter)}"


def _redis_answers(host: str, port: int) -> str | None:
    """None if a Redis PING gets PONG, else why not."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError as exc:
        return f"no Redis at {host}:{port}: {exc}"
    if not reply.startswith(b"+PONG"):
        return f"{host}:{port} answered PING with {reply!r}, not +PONG"
    return None


@pytest.fixture
def redis_url() -> str:
    """URL of the real Redis server; the test is skipped (with the reason) if it is down."""
    problem = _redis_answers(REDIS_HOST, REDIS_PORT)
    if problem is not None:
        pytest.skip(problem)
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/0"
