from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from streamrec.errors import BrokerError
from streamrec.tools.devbroker import DevBroker, free_port, free_port_block

pytestmark = pytest.mark.broker


async def partition_counts(bootstrap: str, topics: list[str]) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
    finally:
        await admin.close()
    return {d["topic"]: len(d["partitions"]) for d in described}


def test_start_create_topics_stop(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    with DevBroker(log_path=log) as dev:
        host, port = dev.bootstrap_servers.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert dev.running
        dev.create_topics({"pb": 4, "ia": 4, "out": 1})
        dev.create_topics({"pb": 4})  # same count again: fine
        with pytest.raises(BrokerError, match=r"'pb' exists with 4 partitions, asked for 2"):
            dev.create_topics({"pb": 2})
        with pytest.raises(BrokerError, match="partitions must be >= 1"):
            dev.create_topics({"zero": 0})
    assert not dev.running
    assert log.exists() and log.stat().st_size > 0  # a given log path is kept
    with pytest.raises(BrokerError, match="not running"):
        _ = dev.bootstrap_servers
    dev.stop()  # idempotent


async def test_async_context_and_round_trip(
    broker: DevBroker, unique_topic: Callable[[str], str]
) -> None:
    topic = unique_topic("rt")
    await broker.create_topics_async({topic: 3})
    assert await partition_counts(broker.bootstrap_servers, [topic]) == {topic: 3}
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all")
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"v", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=broker.bootstrap_servers, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        record = await consumer.getone()
    finally:
        await consumer.stop()
    assert (record.partition, record.offset, record.key, record.value) == (
        meta.partition,
        meta.offset,
        b"k",
        b"v",
    )


async def test_async_context_manager_starts_and_stops() -> None:
    async with DevBroker() as dev:
        await dev.create_topics_async({"a": 2})
        assert await partition_counts(dev.bootstrap_servers, ["a"]) == {"a": 2}
        log = dev.log_path
        assert log is not None and log.exists()
    assert not dev.running
    assert not log.exists()  # an auto-created log is removed after a clean stop


def test_sync_create_topics_inside_running_loop_works(
    broker: DevBroker, unique_topic: Callable[[str], str]
) -> None:
    import asyncio

    topic = unique_topic("sync")

    async def inside_loop() -> None:
        broker.create_topics({topic: 2})  # blocking call from async code (fixtures do this)

    asyncio.run(inside_loop())
    assert asyncio.run(partition_counts(broker.bootstrap_servers, [topic])) == {topic: 2}


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tansu"
    with pytest.raises(BrokerError, match=r"no-such-tansu.*missing or not executable"):
        DevBroker(binary=missing).start()


def test_non_executable_binary_is_a_clear_error(tmp_path: Path) -> None:
    plain = tmp_path / "tansu"
    plain.write_text("not a program")
    plain.chmod(stat.S_IRUSR | stat.S_IWUSR)
    with pytest.raises(BrokerError, match="missing or not executable"):
        DevBroker(binary=plain).start()


def test_binary_that_exits_reports_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "fake-tansu"
    fake.write_text("#!/bin/sh\necho 'fake broker refuses' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(BrokerError, match=r"(?s)exited with code 3.*fake broker refuses"):
        DevBroker(binary=fake, port=free_port()).start()


def test_binary_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "silent-tansu"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    with pytest.raises(BrokerError, match=r"did not answer within 0\.3 s"):
        DevBroker(binary=fake, start_timeout_s=0.3, stop_timeout_s=1.0).start()


def test_port_in_use_by_another_broker_is_reported(broker: DevBroker) -> None:
    port = int(broker.bootstrap_servers.rsplit(":", 1)[1])
    # Tansu itself would exit with status 0 a moment later while the other one answers.
    with pytest.raises(BrokerError, match=f"port 127.0.0.1:{port} is not free"):
        DevBroker(port=port).start()


def test_bad_timeouts_rejected() -> None:
    with pytest.raises(BrokerError, match="-1"):
        DevBroker(start_timeout_s=-1)


def test_cannot_start_twice(broker: DevBroker) -> None:
    with pytest.raises(BrokerError, match="already running"):
        broker.start()
    assert os.path.exists(str(broker.log_path))


def test_port_taken_after_the_check_is_not_mistaken_for_ready(
    broker: DevBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race free_port cannot close: the port is taken between the check and the launch.
    # The other broker answers on it, but with another cluster id, so start() must not
    # report success; the new process exits and start() gives up after its retries.
    import streamrec.tools.devbroker as devbroker_module

    taken = int(broker.bootstrap_servers.rsplit(":", 1)[1])
    monkeypatch.setattr(devbroker_module, "free_port", lambda host, port=0: taken)
    with pytest.raises(BrokerError, match="exited with code 0"):
        DevBroker(start_timeout_s=5.0).start()
    assert broker.running


def test_free_port_block_is_free_and_below_the_ephemeral_range() -> None:
    """The block's ports can all be bound, and none of them is a port the kernel hands
    to outgoing connections (which took a supervisor child's port in CI)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = free_port_block(3)
    assert port >= 10_000 and port + 2 < low
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for i, sock in enumerate(socks):
            sock.bind(("127.0.0.1", port + i))  # raises if taken
    finally:
        for sock in socks:
            sock.close()
