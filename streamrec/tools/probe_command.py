"""``streamrec probe``: one exec probe for every worker process of a pod.

The kubelet's ``httpGet`` probe reaches one port, but a pod running ``streamrec run --gpus
all --workers-per-gpu N`` holds N workers, child i serving ``/healthz`` and ``/readyz`` on
``http.port + i``, and the supervisor restarts children that exit, not ones that hang.
So the GPU overlays probe with ``streamrec probe --ports 9400-9402 --path /readyz`` (an
exec probe; deploy/README.md, "Several GPUs per node"): it GETs
``http://HOST:<port><path>`` on every port at once, each within ``--timeout``, and exits 0
only when all of them answer 200. Each port that does not gets one line on stdout (the
kubelet puts it in the probe's event): the port and the status with the first line of
the worker's answer (``port 9401: 503 not ready: no partitions assigned``), or the error.

The kubelet runs this every few seconds, so it imports the standard library only (the
``streamrec`` command line around it imports no torch either).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import threading
import time
from collections.abc import Sequence
from typing import Final, TextIO

from streamrec.errors import ConfigError

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
MAX_PORTS: Final = 64  # a typo like 9400-94020 is an error, not 8,621 requests
_BODY_CHARS: Final = 200


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ports",
        required=True,
        metavar="SPEC",
        help="ports to probe: a range 9400-9402, a list 9400,9401, or both (9400-9401,9500)",
    )
    parser.add_argument(
        "--path", default="/healthz", help="path to GET on each port (default: %(default)s)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="host the workers listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="per port; the ports are probed at once (default: %(default)s)",
    )


def parse_ports(spec: str) -> list[int]:
    """``9400-9402`` / ``9400,9401`` / ``9400-9401,9500`` -> the ports, in order, once each."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--ports {spec!r}: {why}")

    ports: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise bad("expected ports like 9400-9402 or 9400,9401")
        low, high = int(first), int(last) if dash else int(first)
        if not 1 <= low <= high <= 65535:
            raise bad(f"{part.strip()} is not a port or an ascending range within 1..65535")
        ports.extend(p for p in range(low, high + 1) if p not in ports)
        if len(ports) > MAX_PORTS:
            raise bad(f"more than {MAX_PORTS} ports")
    return ports


def probe_port(host: str, port: int, path: str, timeout: float) -> str | None:
    """None when ``GET path`` on the port answers 200, else what went wrong, in words."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path, headers={"Connection": "close"})
        response = connection.getresponse()
        body = response.read(_BODY_CHARS).decode("utf-8", "replace")
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except ConnectionRefusedError:
        return "connection refused (nothing listens)"
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        connection.close()
    if response.status == 200:
        return None
    first_line = body.strip().splitlines()[0] if body.strip() else response.reason
    return f"{response.status} {first_line}"


def probe_ports(host: str, ports: Sequence[int], path: str, timeout: float) -> dict[int, str]:
    """The failing ports -> why; every port probed at once, all within about ``timeout``.

    Daemon threads with one overall deadline: a port whose answer trickles in slower than
    the socket timeout can notice still fails on time (and does not hold up the exit).
    """
    results: dict[int, str | None] = {}

    def run(port: int) -> None:
        results[port] = probe_port(host, port, path, timeout)

    threads = [threading.Thread(target=run, args=(port,), daemon=True) for port in ports]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 0.5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    failures = {}
    for port in ports:
        if port not in results:
            failures[port] = f"no answer within {timeout:g} s"
        elif (why := results[port]) is not None:
            failures[port] = why
    return failures


def run_probe(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``streamrec probe``: 0 when every port answers 200, else 1 and a line per failure."""
    ports = parse_ports(args.ports)
    if not args.path.startswith("/"):
        raise ConfigError(f"--path {args.path!r}: must start with /")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout}: must be > 0")
    failures = probe_ports(args.host, ports, args.path, args.timeout)
    stream = sys.stdout if out is None else out
    for port, why in failures.items():
        print(f"port {port}: {args.path} {why}", file=stream)
    return EXIT_FAILED if failures else EXIT_OK
