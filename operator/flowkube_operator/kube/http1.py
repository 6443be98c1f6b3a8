"""A small HTTP/1.1 client for the operator's requests to the API server (watches stay on aiohttp).

Why not aiohttp here: a request through aiohttp's ClientSession cost 346-376 us of the process's CPU
(its request and response objects, timers, cookie jar, multidicts), against 179-199 us through `Kube`
on this client, TLS, syscalls and orjson included in both (`tests/benchmarks/bench_http.py` prints
them). The operator makes two requests per Flow from apply to pod and three at the end, on the cores
the API server needs.

What it does, and all it does: keep-alive connections (TLS or plain) in a pool of at most `limit`
in use at once; a request line, headers and a body out; the status and the body back, with the
body framed by Content-Length, chunked transfer encoding, or the connection's end. No redirects,
no compression (none is asked for), no proxies (the API server is reached directly, as aiohttp did
here with its default trust_env=False), no pipelining.

A request that fails on a reused connection before any byte of the answer came back is sent once
more on a new connection: the server may have closed the idle connection as the request went out.
Every write the operator makes is safe to repeat (deterministic names: AlreadyExists is success;
status writes carry the resourceVersion they were planned from: a repeat is a 409 and a re-plan).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import cast
from urllib.parse import urlencode, urlsplit

MAX_HEAD = 64 * 1024  # an API server's response headers are a few hundred bytes
# Connections idle longer are closed rather than reused: kube-apiserver closes them at 90 s, and a
# new one costs a TLS handshake (about 1 ms of the operator's CPU and 0.5 ms of the API server's).
IDLE_SECONDS = 85.0


class ProtocolError(ConnectionError):
    """The server's answer is not HTTP/1.1 as this client reads it."""


class TooLargeError(Exception):
    """The answer's body is over the request's ``max_body``: no more of it is read (the connection is
    closed), so a list page of huge objects costs at most that much memory."""


class _Connection(asyncio.Protocol):
    """One connection, one request at a time: `exchange` writes it and waits for the whole answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reusable = True
        self.answered = False  # some byte of the current answer came back
        self._buf = bytearray()
        self._body = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._length: int | None = None
        self._chunked = False
        self._chunk: int | None = None  # bytes left of the current chunk; -1: reading the trailers
        self._in_head = True
        self._max_body: int | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TLS transport is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if not self._in_head and self._length is None and not self._chunked:
            self._finish(bytes(self._buf))  # the body ran until the connection's end
        else:
            waiter.set_exception(ConnectionResetError(f"the API server closed the connection: {exc or 'EOF'}"))

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.reusable = False  # bytes nobody asked for: never trust this connection again
            self.close()
            return
        self.answered = True
        self._buf += data
        try:
            self._parse()
        except TooLargeError as e:
            self.reusable = False
            self._waiter.set_exception(e)
            self.close()
        except (ValueError, IndexError) as e:
            self.reusable = False
            self._waiter.set_exception(ProtocolError(f"unreadable answer from the API server: {e}"))
            self.close()

    # -- use ----------------------------------------------------------------------------------------

    async def exchange(self, request: bytes, max_body: int | None = None) -> tuple[int, bytes]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._max_body = max_body
        self.answered = False
        self._in_head, self._chunk = True, None
        self._body.clear()
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    # -- reading the answer -------------------------------------------------------------------------

    def _parse(self) -> None:
        if self._in_head and not self._read_head():
            return
        if self._max_body is not None and max(self._length or 0, len(self._body) + len(self._buf)) > self._max_body:
            raise TooLargeError(f"the answer is over {self._max_body} bytes")
        if self._chunked:
            if self._read_chunks():
                self._finish(bytes(self._body))
        elif self._length is not None and len(self._buf) >= self._length:
            body = bytes(self._buf[:self._length])
            del self._buf[:self._length]
            self._finish(body)

    def _read_head(self) -> bool:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise ValueError("response headers over 64 KiB")
                return False
            lines = bytes(self._buf[:end]).split(b"\r\n")
            del self._buf[:end + 4]
            version, status = lines[0].split(b" ", 2)[:2]
            self._status = int(status)
            if 100 <= self._status < 200:
                continue  # an interim answer (100 Continue); the real one follows
            self._length, self._chunked = None, False
            if version != b"HTTP/1.1":
                self.reusable = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == b"content-length":
                    self._length = int(value)
                elif name == b"transfer-encoding":
                    self._chunked = value.endswith(b"chunked")
                elif name == b"connection" and value == b"close":
                    self.reusable = False
            if self._status in (204, 304):
                self._length = 0
            if self._length is None and not self._chunked:
                self.reusable = False  # read until the server closes
            self._in_head = False
            return True

    def _read_chunks(self) -> bool:
        buf = self._buf
        while True:
            if self._chunk is None:  # a size line
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return False
                size = int(bytes(buf[:eol]).split(b";", 1)[0], 16)
                del buf[:eol + 2]
                self._chunk = size if size else -1
            if self._chunk == -1:  # trailers, up to an empty line
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return False
                del buf[:eol + 2]
                if eol == 0:
                    return True
                continue
            if len(buf) < self._chunk + 2:
                return False
            self._body += buf[:self._chunk]
            del buf[:self._chunk + 2]
            self._chunk = None

    def _finish(self, body: bytes) -> None:
        if self._buf:
            self.reusable = False  # more than the answer came: the framing was not what it said
        assert self._waiter is not None
        self._waiter.set_result((self._status, body))


class Pool:
    """Keep-alive connections to one server; at most `limit` requests at once (more wait)."""

    def __init__(self, server: str, ssl_context: ssl.SSLContext | None, *, limit: int,
                 headers: dict[str, str], on_open: Callable[[], None] | None = None) -> None:
        url = urlsplit(server)
        self._host = url.hostname or ""
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._prefix = url.path.rstrip("/")
        self._ssl = ssl_context if url.scheme == "https" else None
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": url.netloc, **headers}.items())
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)
        self._closed = False
        self._on_open = on_open

    async def request(self, method: str, path: str, body: bytes | None, *, headers: dict[str, str],
                      params: dict[str, str] | None = None, max_body: int | None = None) -> tuple[int, bytes]:
        """(status, body); TooLargeError as soon as the body is known to be over ``max_body``."""
        target = self._prefix + path + ("?" + urlencode(params) if params else "")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is not None:
            extra += f"Content-Length: {len(body)}\r\n"
        request = f"{method} {target} HTTP/1.1\r\n{self._head}{extra}\r\n".encode() + (body or b"")
        async with self._slots:
            while True:
                conn, reused = self._take()
                if conn is None:
                    conn = await self._open()
                try:
                    result = await conn.exchange(request, max_body)
                except ConnectionError:
                    conn.close()
                    if reused and not conn.answered:
                        continue  # the server let an idle connection go: once more on a new one
                    raise
                except BaseException:  # cancelled or timed out mid-answer: the connection is spent
                    conn.close()
                    raise
                if conn.reusable and not self._closed:
                    conn.idle_since = asyncio.get_running_loop().time()
                    self._idle.append(conn)
                else:
                    conn.close()
                return result

    def _take(self) -> tuple[_Connection | None, bool]:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            closing = conn.transport is None or conn.transport.is_closing()  # the server's FIN is in
            if conn.reusable and not closing and now - conn.idle_since < IDLE_SECONDS:
                return conn, True
            conn.close()
        return None, False

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            _Connection, self._host, self._port, ssl=self._ssl,
            server_hostname=self._host if self._ssl is not None else None)
        if self._on_open is not None:
            self._on_open()
        return conn

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
