"""The connection's own reads and writes on its descriptor (``_receive``,
``_send_all``): partial writes wait for the peer, EOF and a gone peer are reported
the way trio's streams report them, and the first read of a request is a checkpoint."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing
from trioserve.transport._wire import RECEIVE_SIZE, _receive, _send_all


def _pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def test_a_write_larger_than_the_socket_buffer_waits_for_the_reader():
    a, b = _pair()
    data = bytes(range(256)) * (16 * 1024)  # 4 MiB: far over any socket buffer
    got = bytearray()

    async def reader():
        while len(got) < len(data):
            await trio.lowlevel.wait_readable(b)
            got.extend(b.recv(65536))

    with a, b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await _send_all(a.fileno(), data)
    assert bytes(got) == data


async def test_reads_return_what_is_there_then_eof():
    a, b = _pair()
    with a, b:
        b.send(b"GET / HTTP/1.1\r\n\r\n")
        assert await _receive(a.fileno(), True) == b"GET / HTTP/1.1\r\n\r\n"

        async def later():
            await trio.testing.wait_all_tasks_blocked()
            b.send(b"more")
            b.shutdown(socket.SHUT_WR)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            assert await _receive(a.fileno(), False) == b"more"  # waited for it
        assert await _receive(a.fileno(), False) == b""
    assert RECEIVE_SIZE >= 64 * 1024


async def test_the_first_read_of_a_request_is_a_checkpoint():
    a, b = _pair()
    with a, b:
        b.send(b"x")
        with trio.CancelScope() as scope:
            scope.cancel()
            await _receive(a.fileno(), True)
        assert scope.cancelled_caught
        assert a.recv(1) == b"x"  # nothing was consumed


async def test_writing_to_a_gone_peer_is_a_broken_resource():
    a, b = _pair()
    with a:
        b.close()
        with pytest.raises(trio.BrokenResourceError):
            await _send_all(a.fileno(), b"x" * (8 << 20))  # more than any buffer
