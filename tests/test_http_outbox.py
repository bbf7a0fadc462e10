"""The outbox that writes the data plane's keep-alive answers: the first answer of a
round leaves at once, the others of the round together on the flusher's next run; a
waiting answer cancelled is never written; errors and partial writes reach the
connection that owns the answer. Over socket pairs, no server."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from trioserve.transport._wire import Outbox, _WriteStalled


@pytest.fixture
def pairs():
    made = [socket.socketpair() for _ in range(3)]
    for a, b in made:
        a.setblocking(False)
        b.setblocking(False)
    yield made
    for a, b in made:
        a.close()
        b.close()


@asynccontextmanager
async def flushing() -> AsyncIterator[tuple[Outbox, trio.Nursery]]:
    """An outbox with its flusher running (and parked); the flusher is cancelled when
    the block ends."""
    outbox = Outbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.run)
        await trio.testing.wait_all_tasks_blocked()
        yield outbox, nursery
        nursery.cancel_scope.cancel()


async def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        await trio.lowlevel.wait_readable(sock)
        data += sock.recv(1 << 20)
    return data


async def send_together(outbox: Outbox, answers: list[tuple[int, bytes]]) -> list:
    """Send the answers from one task each, all released into the same scheduler pass;
    return what each send returned (or raised), in order."""
    gate = trio.Event()
    results: list = [None] * len(answers)

    async def one(i: int, fd: int, data: bytes) -> None:
        await gate.wait()
        try:
            results[i] = await outbox.send(fd, data)
        except trio.BrokenResourceError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i, (fd, data) in enumerate(answers):
            nursery.start_soon(one, i, fd, data)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    return results


async def test_one_answer_of_a_round_leaves_at_once_the_others_with_the_flusher(pairs):
    async with flushing() as (outbox, _):
        answers = [(a.fileno(), b"answer %d" % i) for i, (a, _) in enumerate(pairs)]
        waited = await send_together(outbox, answers)
        for i, (_, b) in enumerate(pairs):
            assert await read_exactly(b, len(answers[i][1])) == answers[i][1]
        # the first to run wrote its own; the two behind it waited for the flusher
        assert sorted(waited) == [False, True, True]
        # a lone answer later is again the first of its round
        await trio.testing.wait_all_tasks_blocked()
        assert await outbox.send(pairs[0][0].fileno(), b"alone") is False
        assert pairs[0][1].recv(100) == b"alone"


async def test_without_a_flusher_every_answer_is_written_at_once(pairs):
    outbox = Outbox()  # run() never started: nothing may wait for it
    for i, (a, b) in enumerate(pairs):
        assert await outbox.send(a.fileno(), b"x%d" % i) is False
        assert b.recv(100) == b"x%d" % i


async def test_once_the_flusher_has_ended_every_answer_is_written_at_once(pairs):
    async with flushing() as (outbox, nursery):
        nursery.cancel_scope.cancel()
    answers = [(a.fileno(), b"after %d" % i) for i, (a, _) in enumerate(pairs)]
    assert await send_together(outbox, answers) == [False, False, False]
    for i, (_, b) in enumerate(pairs):
        assert b.recv(100) == b"after %d" % i


async def test_an_answer_cancelled_while_it_waits_is_not_written(pairs):
    async with flushing() as (outbox, _):
        (a0, b0), (a1, b1) = pairs[0], pairs[1]
        # the first answer of a round: written at once, the flusher woken
        assert await outbox.send(a0.fileno(), b"first") is False
        assert b0.recv(100) == b"first"
        # still in the same pass, so a second answer waits; cancelled, it is withdrawn
        with trio.CancelScope() as waiting:
            waiting.cancel()
            await outbox.send(a1.fileno(), b"second")
        assert waiting.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()  # the flusher has run
        with pytest.raises(BlockingIOError):
            b1.recv(100)  # never written
        # the connection can answer again afterwards
        assert await outbox.send(a1.fileno(), b"third") is False
        assert b1.recv(100) == b"third"


async def test_a_gone_peer_fails_its_own_answer_only(pairs):
    async with flushing() as (outbox, _):
        for _, b in pairs[:2]:
            b.close()  # these clients went away
        answers = [(a.fileno(), b"answer") for a, _ in pairs]
        results = await send_together(outbox, answers)
        assert isinstance(results[0], trio.BrokenResourceError)
        assert isinstance(results[1], trio.BrokenResourceError)
        assert results[2] in (False, True)
        assert await read_exactly(pairs[2][1], 6) == b"answer"


async def test_answers_larger_than_the_socket_buffer_arrive_whole(pairs):
    big = [bytes([65 + i]) * (4 << 20) for i in range(3)]
    received: dict[int, bytes] = {}

    async def reader(i: int) -> None:
        received[i] = await read_exactly(pairs[i][1], len(big[i]))

    async with flushing() as (outbox, nursery):
        for i in range(3):
            nursery.start_soon(reader, i)
        waited = await send_together(outbox, [(a.fileno(), big[i])
                                              for i, (a, _) in enumerate(pairs)])
        assert sorted(waited) == [False, True, True]
        await trio.testing.wait_all_tasks_blocked()
    assert [received[i] == big[i] for i in range(3)] == [True, True, True]


async def test_a_waiting_answer_the_socket_stops_taking_stalls_after_its_bound(
    pairs, autojump_clock
):
    """The flusher writes what the socket takes; the rest is the connection's to wait
    for, at most ``stall_after`` with no byte taken: then _WriteStalled."""
    big = b"x" * (4 << 20)  # more than any socket buffer: the peer never reads
    async with flushing() as (outbox, _):
        (a0, b0), (a1, _) = pairs[0], pairs[1]
        assert await outbox.send(a0.fileno(), b"first", 20.0) is False  # opens a round
        t0 = trio.current_time()
        with pytest.raises(_WriteStalled):
            await outbox.send(a1.fileno(), big, 20.0)  # waits for the flusher, then stalls
        assert trio.current_time() == t0 + 20.0
        assert b0.recv(100) == b"first"
