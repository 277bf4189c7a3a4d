"""``streamrec broker``: the dev broker on the configured address with the configured
topics, stopped cleanly by Ctrl-C (issue 17, item 1)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from streamrec.errors import ConfigError
from streamrec.tools.broker_command import listen_port
from streamrec.tools.devbroker import DevBroker, free_port

STREAMREC = Path(sys.executable).with_name("streamrec")


@pytest.mark.parametrize(
    ("servers", "port"), [("127.0.0.1:9092", 9092), (" localhost:19092 ", 19092)]
)
def test_listen_port_of_a_loopback_address(servers: str, port: int) -> None:
    assert listen_port(servers) == port


@pytest.mark.parametrize("servers", ["kafka-0:9092", "127.0.0.1:1,127.0.0.1:2", "127.0.0.1"])
def test_other_addresses_are_a_config_error(servers: str) -> None:
    with pytest.raises(ConfigError, match=r"one 127\.0\.0\.1:PORT"):
        listen_port(servers)


async def describe(bootstrap: str) -> dict[str, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        names = ["playback-events", "interaction-events", "recs", "streamrec-dlq"]
        return {d["topic"]: len(d["partitions"]) for d in await admin.describe_topics(names)}
    finally:
        await admin.close()


@pytest.mark.broker
def test_broker_command_creates_the_topics_and_stops_on_ctrl_c() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [str(STREAMREC), "broker", "--bootstrap-servers", f"127.0.0.1:{port}",
         "--partitions", "3", "--set", "topics.output=recs"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith(f"dev broker at 127.0.0.1:{port} ")
        assert "playback-events (3)" in proc.stdout.readline()
        assert asyncio.run(describe(f"127.0.0.1:{port}")) == {
            "playback-events": 3,
            "interaction-events": 3,
            "recs": 3,
            "streamrec-dlq": 1,
        }
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "dev broker stopped"
    assert "Traceback" not in err
    free_port("127.0.0.1", port)  # the Tansu process is gone with it


@pytest.mark.broker
def test_a_taken_port_is_one_line_and_status_1(broker: DevBroker) -> None:
    done = subprocess.run(
        [str(STREAMREC), "broker", "--bootstrap-servers", broker.bootstrap_servers],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("streamrec broker: error: port ")
    assert done.stderr.count("\n") == 1 and "not free" in done.stderr
