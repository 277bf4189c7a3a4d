"""``streamrec probe``: the exec probe of a pod's worker processes, against real HTTP
servers (stdlib ``http.server`` in threads) standing in for the workers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamrec.tools.cli import main
from streamrec.tools.devbroker import free_port
from streamrec.tools.probe_command import parse_ports


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    status = 200
    body = b"ok"
    delay_s = 0.0
    paths: list[str]

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a hung worker's late answer meets a closed connection: expected


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        time.sleep(self.server.delay_s)
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[list[_Server]]:
    """Three workers answering 200 until a test changes one."""
    started = []
    for _ in range(3):
        server = _Server(("127.0.0.1", 0), _Handler)
        server.paths = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def ports_of(servers: list[_Server]) -> str:
    return ",".join(str(s.server_address[1]) for s in servers)


def probe(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    status = main(["probe", *argv])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def test_every_port_answering_200_is_success(
    servers: list[_Server], capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines, err = probe(capsys, "--ports", ports_of(servers), "--path", "/readyz")
    assert (status, lines, err) == (0, [], "")
    assert [s.paths for s in servers] == [["/readyz"]] * 3


def test_one_unhealthy_worker_fails_the_probe_and_is_named(
    servers: list[_Server], capsys: pytest.CaptureFixture[str]
) -> None:
    servers[1].status = 503
    servers[1].body = b"not ready: no partitions assigned\nmore detail"
    status, lines, _ = probe(capsys, "--ports", ports_of(servers), "--path", "/readyz")
    port = servers[1].server_address[1]
    assert status == 1
    assert lines == [f"port {port}: /readyz 503 not ready: no partitions assigned"]


def test_a_closed_port_fails_the_probe(
    servers: list[_Server], capsys: pytest.CaptureFixture[str]
) -> None:
    closed = free_port()  # free: nothing listens there
    status, lines, _ = probe(capsys, "--ports", f"{ports_of(servers)},{closed}")
    assert status == 1
    assert lines == [f"port {closed}: /healthz connection refused (nothing listens)"]


def test_a_hung_worker_fails_within_the_timeout(
    servers: list[_Server], capsys: pytest.CaptureFixture[str]
) -> None:
    # The case the supervisor cannot see: a child that runs but does not answer.
    for server in servers:
        server.delay_s = 3.0
    start = time.monotonic()
    status, lines, _ = probe(capsys, "--ports", ports_of(servers), "--timeout", "0.3")
    assert time.monotonic() - start < 2.0, "the ports are probed at once, not one by one"
    assert status == 1
    assert [line.split(": ", 1)[1] for line in lines] == ["/healthz no answer within 0.3 s"] * 3


@pytest.mark.parametrize(
    ("spec", "ports"),
    [
        ("9400-9402", [9400, 9401, 9402]),
        ("9400", [9400]),
        ("9400,9402", [9400, 9402]),
        ("9400-9401, 9500", [9400, 9401, 9500]),
        ("9400-9401,9401", [9400, 9401]),
    ],
)
def test_port_specs(spec: str, ports: list[int]) -> None:
    assert parse_ports(spec) == ports


@pytest.mark.parametrize("spec", ["94a", "9402-9400", "9400-", "", "0", "70000", "9400-9500"])
def test_a_bad_port_spec_is_a_one_line_error_naming_it(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines, err = probe(capsys, "--ports", spec)
    assert status == 1 and lines == []
    assert err.count("\n") == 1 and err.startswith(f"streamrec probe: error: --ports {spec!r}: ")


def test_a_path_without_a_slash_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = probe(capsys, "--ports", "9400", "--path", "readyz")
    assert status == 1 and "--path 'readyz': must start with /" in err


def test_the_probe_imports_nothing_heavy(servers: list[_Server]) -> None:
    """The kubelet runs it every few seconds: no torch, no Kafka client, no numpy."""
    code = (
        "import sys\n"
        "from streamrec.tools.cli import main\n"
        f"status = main(['probe', '--ports', {ports_of(servers)!r}])\n"
        "print(status, sorted(m for m in ('torch', 'aiokafka', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip().splitlines()[-1] == "0 []"
