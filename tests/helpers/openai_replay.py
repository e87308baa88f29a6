"""A tiny loopback HTTP server that replays recorded responses, for the OpenAI client tests.

It speaks raw HTTP/1.1 over asyncio streams so each test controls exactly how the body is cut
into TCP writes (1 byte, 7 bytes, random sizes), how often a status repeats, or that the server
never answers. It runs in its own thread; ``stop()`` ends it (use it as a context manager).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from dataclasses import dataclass, field

from tests.helpers.paths import FIXTURES_DIR

FIXTURES = FIXTURES_DIR / "openai"


def fixture(name: str) -> bytes:
    """Bytes of a file under tests/fixtures/openai."""
    return (FIXTURES / name).read_bytes()


@dataclass
class Reply:
    """One canned response.

    Attributes:
        status: HTTP status.
        body: bytes sent after the headers.
        content_type: Content-Type header.
        chunks: "whole", an int n (n-byte writes) or "random" (1..23-byte writes, seeded).
        headers: extra headers (e.g. Retry-After).
        hang: accept the request and never answer.
    """

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    chunks: object = "whole"
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False


def sse_reply(name: str, chunks: object = "whole") -> Reply:
    """A 200 text/event-stream reply of a fixture."""
    return Reply(body=fixture(name), content_type="text/event-stream", chunks=chunks)


def sse_data(response_or_chunks: object) -> list[str]:
    """The ``data`` of each server-sent event, parsed by httpx-sse as the client parses them:
    of a streamed response, or of byte chunks (received in exactly those pieces)."""
    import httpx
    from httpx_sse import EventSource

    resp = response_or_chunks
    if not hasattr(resp, "iter_text"):  # (Starlette's TestClient answers with httpx2's Response)
        resp = httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=iter(list(response_or_chunks)))  # fmt: skip
    return [event.data for event in EventSource(resp).iter_sse()]


def json_reply(obj: object, status: int = 200, **kw: object) -> Reply:
    """A JSON reply."""
    return Reply(status=status, body=json.dumps(obj).encode(), **kw)


class ReplayServer:
    """Routes "METHOD /path" -> list of Replies, served in order (the last one repeats).

    A route may also be a callable taking the parsed JSON body (or None) and returning a Reply.
    ``requests`` records (method, path, headers, json body) of every request received.
    """

    def __init__(self, routes: dict[str, object]):
        self.routes = {k: (v if callable(v) else list(v)) for k, v in routes.items()}
        self.counts: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict, object]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    def __enter__(self) -> ReplayServer:
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        future.result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self.server is not None:
                self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)

    def _pick(self, key: str, body: object) -> Reply:
        route = self.routes.get(key)
        if route is None:
            return json_reply({"error": {"message": f"no route {key}"}}, status=404)
        if callable(route):
            return route(body)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        return route[min(n, len(route) - 1)]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            body = json.loads(raw) if raw else None
            self.requests.append((method, path, headers, body))
            reply = self._pick(f"{method} {path}", body)
            if reply.hang:
                await asyncio.sleep(3600)
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            writer.write(
                f"HTTP/1.1 {reply.status} X\r\nContent-Type: {reply.content_type}\r\n{extra}"
                f"Connection: close\r\n\r\n".encode()
            )
            await writer.drain()
            for piece in _pieces(reply.body, reply.chunks):
                writer.write(piece)
                await writer.drain()
                if reply.chunks != "whole":
                    await asyncio.sleep(0.0005)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def _pieces(body: bytes, mode: object) -> list[bytes]:
    if mode == "whole":
        return [body]
    if isinstance(mode, int):
        return [body[i : i + mode] for i in range(0, len(body), mode)]
    rng = random.Random(1234)
    out, i = [], 0
    while i < len(body):
        n = rng.randint(1, 23)
        out.append(body[i : i + n])
        i += n
    return out
