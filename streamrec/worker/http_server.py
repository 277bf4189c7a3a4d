"""One small HTTP/1.1 server for ``/metrics``, ``/healthz`` and ``/readyz``.

Three GET routes answered from in-memory state need no web framework: the server reads the
request line, skips the headers, calls the route's handler and closes the connection
(``Connection: close``), which is all Prometheus and the kubelet probes need. Handlers are
plain callables so this module knows nothing about metrics or Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

_MAX_REQUEST_LINE: Final = 8_192
_READ_TIMEOUT_S: Final = 5.0
_REASONS: Final = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Unavailable"}


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Response]


class HttpServer:
    """``routes`` maps a path to a handler; ``port`` 0 picks a free port (see ``port``)."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        self._host = host
        self._requested_port = port
        self._routes = dict(routes)
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the HTTP server is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self._host, self._requested_port, reuse_address=True
        )
        log.info("http listening", extra={"host": self._host, "port": self.port})

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            response = await self._respond(reader)
            head = (
                f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}\r\n"
                f"Content-Type: {response.content_type}\r\n"
                f"Content-Length: {len(response.body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + response.body)
            await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass  # the client went away or sent garbage: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> Response:
        line = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
        if len(line) > _MAX_REQUEST_LINE:
            raise ValueError("request line too long")
        while True:  # skip headers up to the blank line
            header = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
            if header in (b"\r\n", b"\n", b""):
                break
        parts = line.decode("latin-1").split()
        if len(parts) < 2:
            raise ValueError(f"bad request line {line[:80]!r}")
        method, target = parts[0], parts[1]
        path = target.split("?", 1)[0]
        handler = self._routes.get(path)
        if handler is None:
            return Response(404, f"no route {path}\n".encode())
        if method not in ("GET", "HEAD"):
            return Response(405, f"{method} not allowed\n".encode())
        response = handler()
        if method == "HEAD":
            return Response(response.status, b"", response.content_type)
        return response
