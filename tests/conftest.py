"""Shared fixtures: a real dev broker for the session and the real Redis server; the CPU
AOTI packages that some tests load, built in the background (tests/models/aoti_prebuild.py).

Neither the broker nor Redis is mocked (DESIGN §8). The whole suite shares one broker
process; tests stay independent by creating their own topics with names from
``unique_topic`` (note that Tansu auto-creates an unknown topic on a metadata request, so
create topics first).
"""

from __future__ import annotations

import itertools
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from streamrec.tools.devbroker import DevBroker

if TYPE_CHECKING:
    from tests.models.aoti_prebuild import Schedule

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


_AOTI: pytest.StashKey[Schedule] = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after -k and -m took out what does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A session with a test that waits for a background build (``<name>_prebuilt``) gets
    a ``Schedule``: those modules run last, the builds start with the worker tests."""
    if any(
        name.endswith("_prebuilt") for item in items for name in getattr(item, "fixturenames", ())
    ):
        from tests.models.aoti_prebuild import Schedule  # torch: only where it is needed

        config.stash[_AOTI] = Schedule(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    schedule = item.config.stash.get(_AOTI, None)
    if schedule is not None:
        schedule.before(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    schedule = session.config.stash.get(_AOTI, None)
    if schedule is not None:
        schedule.stop()


def _wait_for_build(request: pytest.FixtureRequest, name: str) -> None:
    """Until ``name``'s background build has ended; nothing without a schedule (the test
    then compiles what it needs itself)."""
    schedule = request.config.stash.get(_AOTI, None)
    if schedule is not None:
        schedule.wait(name)


@pytest.fixture(scope="session")
def serving_prebuilt(request: pytest.FixtureRequest) -> None:
    """The serving package's background build has ended (test_aoti_runtime.py,
    worker/test_model_loader.py)."""
    _wait_for_build(request, "serving")


@pytest.fixture(scope="session")
def fp8_prebuilt(request: pytest.FixtureRequest) -> None:
    """The FP8 package's background build has ended (test_quantization.py)."""
    _wait_for_build(request, "fp8")


@pytest.fixture(scope="session")
def generation_prebuilt(request: pytest.FixtureRequest) -> None:
    """The generation package's background build has ended (test_aoti_extend_scratch.py)."""
    _wait_for_build(request, "generation")
