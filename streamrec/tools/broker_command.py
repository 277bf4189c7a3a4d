"""``streamrec broker``: the dev broker (Tansu) as a foreground command for trying things out.

It listens where the configuration says Kafka is (``kafka.bootstrap_servers``, which must
be one loopback ``host:port``), so ``streamrec run``, ``produce`` and ``consume`` with the
same configuration find it without flags; it creates the four topics of ``[topics]``
(inputs and output with ``--partitions`` each, the dead-letter topic with one) and runs
until Ctrl-C or SIGTERM. Memory storage only: everything is gone when it stops.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Final, TextIO

from streamrec.errors import BrokerError, ConfigError
from streamrec.tools.devbroker import DevBroker
from streamrec.worker.config import TopicsConfig, WorkerConfig

_LOOPBACK: Final = ("127.0.0.1", "localhost")
_POLL_S: Final = 0.2


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="partitions of each input topic and of the output topic",
    )


def listen_port(bootstrap_servers: str) -> int:
    """The port of a single loopback ``host:port`` (the dev broker listens on IPv4 loopback)."""
    servers = [s.strip() for s in bootstrap_servers.split(",") if s.strip()]
    host, sep, port = servers[0].rpartition(":") if len(servers) == 1 else ("", "", "")
    if not sep or host not in _LOOPBACK or not port.isdigit():
        raise ConfigError(
            f"kafka.bootstrap_servers = {bootstrap_servers!r}: the dev broker needs one "
            "127.0.0.1:PORT (it listens on IPv4 loopback only)"
        )
    return int(port)


def broker_topics(topics: TopicsConfig, partitions: int) -> dict[str, int]:
    if partitions < 1:
        raise ConfigError(f"--partitions {partitions}: must be >= 1")
    return {
        topics.playback: partitions,
        topics.interaction: partitions,
        topics.output: partitions,
        topics.dead_letter: 1,
    }


def run_broker(config: WorkerConfig, partitions: int, out: TextIO | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status (1 if the broker died)."""
    out = out if out is not None else sys.stdout  # looked up per call: tests capture it
    port = listen_port(config.kafka.bootstrap_servers)
    topics = broker_topics(config.topics, partitions)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # Explicit handlers: a shell starts `streamrec broker &` with SIGINT ignored.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    broker = DevBroker(port=port)
    try:
        broker.start()
        broker.create_topics(topics)
        listing = ", ".join(f"{name} ({n})" for name, n in topics.items())
        out.write(
            f"dev broker at {broker.bootstrap_servers} (in memory: nothing survives a stop)\n"
            f"topics (partitions): {listing}\n"
            "Ctrl-C to stop\n"
        )
        out.flush()
        while not stop.wait(_POLL_S):
            if not broker.running:
                raise BrokerError(
                    f"the dev broker at 127.0.0.1:{port} exited by itself; "
                    f"log {str(broker.log_path)!r}"
                )
    finally:
        broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    out.write("dev broker stopped\n")
    out.flush()
    return 0
