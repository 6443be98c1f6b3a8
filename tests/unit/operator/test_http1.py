"""The operator's HTTP/1.1 client reads every framing Go's net/http (the API server) sends, keeps
connections alive, and never hands a spent connection to the next request. A scripted TCP server
plays the API server byte by byte, so the framing is exactly what the test writes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from flowkube_operator.kube.http1 import Pool, ProtocolError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


async def _serve(script: Script, requests: list[tuple[str, str, bytes | None]]) -> tuple[list[object], int]:
    """Send `requests` one after the other through one Pool; the answers (or errors) and how many
    connections the server saw."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(f"http://127.0.0.1:{port}", None, limit=4, headers={"User-Agent": "test"})
    out: list[object] = []
    try:
        for method, path, body in requests:
            try:
                out.append(await asyncio.wait_for(pool.request(method, path, body, headers={}), 5))
            except (ConnectionError, TimeoutError) as e:
                out.append(e)
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()
    return out, connections


def run(script: Script, requests: list[tuple[str, str, bytes | None]]) -> tuple[list[object], int]:
    return asyncio.run(_serve(script, requests))


def test_content_length_answers_share_one_kept_alive_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await _head(reader)
            body = b'{"path":"' + head.split(b" ")[1] + b'"}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    out, connections = run(script, [("GET", "/a", None), ("POST", "/b", b'{"x":1}'), ("GET", "/c?x=1", None)])
    assert out == [(200, b'{"path":"/a"}'), (200, b'{"path":"/b"}'), (200, b'{"path":"/c?x=1"}')]
    assert connections == 1


def test_a_chunked_answer_split_anywhere_is_put_together() -> None:
    body = b'{"items":[' + b",".join(b'{"n":%d}' % i for i in range(300)) + b"]}"
    chunks = [body[i:i + 700] for i in range(0, len(body), 700)]
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nX-Trailer: y\r\n\r\n"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _head(reader)
            for i in range(0, len(wire), 97):  # cut through size lines, data and the CRLFs
                writer.write(wire[i:i + 97])
                await writer.drain()

    out, connections = run(script, [("GET", "/list", None), ("GET", "/list", None)])
    assert out == [(200, body), (200, body)]
    assert connections == 1


def test_connection_close_and_read_until_end_are_not_reused() -> None:
    answers = [b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
               b"HTTP/1.1 200 OK\r\n\r\nno length: the body ends with the connection"]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        if not answers:
            return  # closes without an answer
        writer.write(answers.pop(0))
        await writer.drain()

    out, connections = run(script, [("POST", "/a", b"{}"), ("GET", "/b", None), ("GET", "/c", None)])
    assert out[:2] == [(201, b"{}"), (200, b"no length: the body ends with the connection")]
    assert isinstance(out[2], ConnectionError)  # the script has no third answer
    assert connections == 3


def test_an_idle_connection_the_server_closed_is_replaced_without_an_error() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # then close without a word, as a server does with an idle keep-alive connection

    out, connections = run(script, [("GET", "/a", None), ("GET", "/b", None), ("GET", "/c", None)])
    assert out == [(200, b"ok")] * 3
    assert connections == 3


def test_a_request_cut_off_mid_answer_fails_and_its_connection_is_not_reused() -> None:
    served = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _head(reader)
        served += 1
        if served == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")  # 3 of 10, then gone
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        if served == 2:
            await _head(reader)  # keeps the connection for a request that never comes

    out, connections = run(script, [("GET", "/a", None), ("DELETE", "/b", None)])
    assert isinstance(out[0], ConnectionError)  # part of an answer came: not silently sent again
    assert out[1] == (204, b"")
    assert connections == 2


def test_a_cancelled_request_leaves_no_half_read_connection_behind() -> None:
    async def main() -> list[tuple[int, bytes]]:
        slow = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await _head(reader)
            if b"/slow" in head:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nsl")
                await writer.drain()
                await slow.wait()
                writer.write(b"ow")  # the rest of the first answer, which nobody wants now
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfast")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", None, limit=1, headers={})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.request("GET", "/slow", None, headers={}), 0.5)
        slow.set()
        out = [await asyncio.wait_for(pool.request("GET", "/fast", None, headers={}), 5)]
        await pool.close()
        server.close()
        await server.wait_closed()
        return out

    assert asyncio.run(main()) == [(200, b"fast")]


def test_an_answer_that_is_not_http_is_an_error_and_its_connection_is_dropped() -> None:
    served = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            await _head(reader)
            served += 1
            writer.write(b"SSH-2.0-nonsense\r\n\r\n" if served == 1 else
                         b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    out, connections = run(script, [("GET", "/a", None), ("GET", "/b", None)])
    assert isinstance(out[0], ProtocolError) and "unreadable answer" in str(out[0])
    assert out[1] == (200, b"ok")
    assert connections == 2  # the garbled connection was not used again


def test_an_answer_over_max_body_is_cut_off_as_it_comes_by_length_or_chunks() -> None:
    """A list page of huge objects: refused once its Content-Length, or its chunks so far, say it is
    over the bound, with no more of it read; the connection is not reused."""
    from flowkube_operator.kube.http1 import TooLargeError

    async def go() -> list[object]:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await _head(reader)
            if b"/length" in head:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50000000\r\n\r\n" + b"x" * 1000)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(40):
                    writer.write(b"400\r\n" + b"y" * 1024 + b"\r\n")
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()  # until the client hangs up

        server = await asyncio.start_server(script, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", None, limit=4, headers={})
        out: list[object] = []
        try:
            for path, bound in (("/length", 1_000_000), ("/chunked", 10_000), ("/chunked", 100_000)):
                try:
                    out.append(await asyncio.wait_for(pool.request("GET", path, None, headers={},
                                                                   max_body=bound), 5))
                except TooLargeError as e:
                    out.append(e)
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()
        return out

    too_long, too_chunky, fits = asyncio.run(go())
    assert isinstance(too_long, TooLargeError) and isinstance(too_chunky, TooLargeError)
    assert fits == (200, b"y" * 40 * 1024)
