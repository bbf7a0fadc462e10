"""Connecting Ray (``start_ray``) when ``ray.init`` fails or hangs: every failure is a
ConfigError naming the Ray and the cause; a ``ray.init`` that has not returned within
``ray.start_timeout_s`` fails the start and holds no lock, so another start or a stop
is not held up by it. Ray's functions are replaced by fakes: no Ray runs."""

from __future__ import annotations

import logging
import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S
from trioserve import ConfigError, RayConfig

ray = pytest.importorskip("ray")


class FakeRay:
    """``ray.init`` / ``ray.shutdown`` / ``ray.is_initialized`` of a Ray that connects
    when ``release`` is set (at once unless ``hang``), or raises ``error`` (once), and
    disconnects when ``stopped`` is set (at once unless ``hang_shutdown``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.connected = False
        self.error: BaseException | None = None
        self.release = threading.Event()
        self.release.set()
        self.stopped = threading.Event()
        self.stopped.set()
        self.stopping = threading.Event()  # a ray.shutdown has begun

    def hang(self) -> None:
        self.release.clear()

    def hang_shutdown(self) -> None:
        self.stopped.clear()

    def init(self, **kw) -> None:
        self.calls.append("init")
        self.release.wait()
        error, self.error = self.error, None  # the next init connects
        if error is not None:
            raise error
        self.connected = True

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.stopping.set()
        self.stopped.wait(GATE_LIMIT_S)
        self.connected = False


@pytest.fixture
def fake(monkeypatch):
    f = FakeRay()
    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(trioserve._ray_connect, "_connecting", None)
    monkeypatch.setattr(trioserve._ray_connect, "_stopping", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: f.connected)
    monkeypatch.setattr(ray, "init", f.init)
    monkeypatch.setattr(ray, "shutdown", f.shutdown)
    yield f
    f.release.set()  # a hung init returns: its thread ends
    f.stopped.set()  # and a hung shutdown
    for t in threading.enumerate():
        if t.name == "trioserve-ray" and t is not threading.current_thread():
            t.join(timeout=10)


def _ray_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trioserve-ray"]


def _state() -> tuple:
    r = trioserve._ray_connect
    return r._users, r._owner, r._connecting, r._stopping


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("no cluster there"),
        ValueError("address must be host:port"),
        RuntimeError("Ray has not been started yet"),
        TimeoutError("timed out waiting for the GCS"),
    ],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize(
    ("address", "named"),
    [
        ("ray://nowhere:1", "ray.address: cannot connect to Ray at 'ray://nowhere:1'"),
        (None, "ray: cannot connect to a local Ray (ray.address is not set: one is started "
               "in this process)"),
    ],
)
async def test_every_failure_of_ray_init_is_a_config_error_naming_the_ray_and_the_cause(
    fake, error, address, named
):
    """Only ConnectionError was: a ValueError on a bad address, a RuntimeError or a
    timeout of Ray's came out as a traceback."""
    fake.error = error
    with pytest.raises(ConfigError) as info:
        await trioserve._ray_connect.start_ray(RayConfig(address=address))
    assert str(info.value) == f"{named}: {type(error).__name__}: {error}"
    assert info.value.__cause__ is error
    assert fake.calls == ["init"]
    assert not _ray_threads()
    assert _state() == (0, None, None, None)


async def test_a_ray_init_that_hangs_fails_the_start_at_its_timeout(fake, autojump_clock):
    fake.hang()
    start = trio.current_time()
    with pytest.raises(ConfigError) as info:
        await trioserve._ray_connect.start_ray(
            RayConfig(address="ray://slow:1", start_timeout_s=5.0)
        )
    assert trio.current_time() - start == 5.0
    assert str(info.value) == (
        "ray.start_timeout_s: cannot connect to Ray at 'ray://slow:1': ray.init has not "
        "returned within 5 s (it is left to finish, and disconnected if it connects); "
        "check the address, or allow longer"
    )
    assert fake.calls == ["init"]
    # no lock is held for it: a stop or another start can take the lock at once
    assert trioserve._ray_connect._users_lock.acquire(blocking=False)
    trioserve._ray_connect._users_lock.release()
    users, owner, connecting, _ = _state()
    assert (users, owner) == (0, None)
    assert connecting is not None
    assert connecting.state == "abandoned"


async def test_an_abandoned_ray_init_that_connects_late_is_disconnected_and_a_new_start_works(
    fake,
):
    fake.hang()
    hung = trioserve._ray_connect.RayThread(lambda: ray.init(), ray.shutdown)
    # what start_ray does at its timeout, without waiting for one
    trioserve._ray_connect._connecting = hung
    hung.launch()
    with trioserve._ray_connect._users_lock:
        hung.state = "abandoned"
    fake.release.set()  # ray.init returns, connected: nobody uses it
    await trio.to_thread.run_sync(hung.join)
    assert fake.calls == ["init", "shutdown"]
    assert not fake.connected
    assert _state() == (0, None, None, None)
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    assert fake.calls == ["init", "shutdown", "init"]
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == ["init", "shutdown", "init", "shutdown"]
    assert _state() == (0, None, None, None)


async def test_a_start_while_an_earlier_ray_init_hangs_waits_for_it_within_its_own_timeout(
    fake, autojump_clock
):
    """No second ray.init runs beside a hung one; the second start fails at its own
    timeout, saying why."""
    fake.hang()
    with pytest.raises(ConfigError):
        await trioserve._ray_connect.start_ray(RayConfig(start_timeout_s=5.0))
    start = trio.current_time()
    with pytest.raises(ConfigError) as info:
        await trioserve._ray_connect.start_ray(RayConfig(start_timeout_s=3.0))
    assert trio.current_time() - start == 3.0
    assert str(info.value) == (
        "ray.start_timeout_s: cannot connect to a local Ray (ray.address is not set: one "
        "is started in this process): an earlier ray.init of this process has not "
        "returned within 3 s"
    )
    assert fake.calls == ["init"]


def watch_waits(mp, method: str, n: int, wrap=lambda wake: wake):
    """Patch ``RayThread.<method>`` (``on_settled`` or ``on_ended``: a start or a stop
    waiting for the Ray thread) to note each wait as it registers: returns the
    threads waited for (one per wait) and an event set once ``n`` are. ``wrap``:
    what the thread calls instead of the wait's own wake-up."""
    registered = trio.Event()
    threads = []
    register = getattr(trioserve._ray_connect.RayThread, method)

    def seen(self, wake):
        threads.append(self)
        register(self, wrap(wake))
        if len(threads) == n:
            registered.set()

    mp.setattr(trioserve._ray_connect.RayThread, method, seen)
    return threads, registered


async def test_a_start_after_a_hung_ray_init_returned_connects_within_its_timeout(fake):
    """The earlier init returns (and fails) while the second start waits for it: the
    second then connects on its own."""
    fake.hang()
    fake.error = ConnectionError("refused")
    first = trioserve._ray_connect.RayThread(lambda: ray.init(), ray.shutdown)
    trioserve._ray_connect._connecting = first
    first.launch()
    with trioserve._ray_connect._users_lock:
        first.state = "abandoned"

    async def release_when_waiting():
        await waiting.wait()
        fake.release.set()

    with pytest.MonkeyPatch.context() as mp:
        _, waiting = watch_waits(mp, "on_settled", 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_when_waiting)
            assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    assert fake.calls == ["init", "init"]  # the first one's, then the second start's
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == ["init", "init", "shutdown"]


async def test_no_ray_init_starts_once_the_time_went_waiting_for_one_that_failed(
    fake, mock_clock
):
    """The earlier ray.init fails as this start's timeout ends: no second ray.init is
    started, to be given up at once."""
    fake.hang()
    fake.error = ConnectionError("refused")
    first = trioserve._ray_connect.RayThread(lambda: ray.init(), ray.shutdown)
    trioserve._ray_connect._connecting = first
    first.launch()
    with trioserve._ray_connect._users_lock:
        first.state = "abandoned"
    token = trio.lowlevel.current_trio_token()

    def late(wake):
        def late_wake():
            # on the event loop, in this order: the timeout passes, then the wake-up
            token.run_sync_soon(mock_clock.jump, 3.0)
            wake()

        return late_wake

    async def fail_when_waiting():
        await waiting.wait()
        fake.release.set()

    with pytest.MonkeyPatch.context() as mp:
        _, waiting = watch_waits(mp, "on_settled", 1, late)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_when_waiting)
            with pytest.raises(ConfigError) as info:
                await trioserve._ray_connect.start_ray(RayConfig(start_timeout_s=3.0))
    assert str(info.value) == (
        "ray.start_timeout_s: cannot connect to a local Ray (ray.address is not set: one "
        "is started in this process): its 3 s passed waiting for an earlier ray.init of "
        "this process, which failed"
    )
    assert fake.calls == ["init"]
    assert _state() == (0, None, None, None)


async def test_two_starts_at_once_connect_ray_once_and_count_two_users(fake):
    """The second start waits for the first's ray.init (holding no lock) and then
    uses the Ray it connected."""
    fake.hang()
    results = []

    async def start():
        results.append(await trioserve._ray_connect.start_ray(RayConfig()))

    with pytest.MonkeyPatch.context() as mp:
        waiters, registered = watch_waits(mp, "on_settled", 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start)
            nursery.start_soon(start)
            await registered.wait()
            assert waiters[0] is waiters[1]  # both wait for the one ray.init
            fake.release.set()
    assert results == [True, True]
    assert fake.calls == ["init"]
    assert trioserve._ray_connect._users == 2
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == ["init"]
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == ["init", "shutdown"]
    assert _state() == (0, None, None, None)


async def test_a_stop_with_no_runtime_counted_leaves_ray_alone(fake, caplog):
    """Every user counted is counted with the thread that connected Ray, so the last
    stop always has that thread to disconnect it (and to keep a start from running
    ray.init beside a hung shutdown). A stop with none counted (after a start that
    found the process's own Ray connected, False: not to be stopped; or a second
    stop of one start) has nothing of ours to stop: it logs that, and neither calls
    ray.shutdown (which no start would wait for) nor disconnects the process's Ray."""
    caplog.set_level(logging.ERROR, logger="trioserve")
    fake.connected = True  # the process's own code connected it
    assert await trioserve._ray_connect.start_ray(RayConfig()) is False
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == []
    assert fake.connected
    assert _state() == (0, None, None, None)
    fake.connected = False
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    await trioserve._ray_connect.stop_ray()
    await trioserve._ray_connect.stop_ray()  # once too often
    assert fake.calls == ["init", "shutdown"]
    assert _state() == (0, None, None, None)
    assert [r.getMessage() for r in caplog.records] == [
        "stop_ray() with no runtime using the Ray start_ray connected: nothing to stop "
        "(Ray, if connected, is left as it is)"
    ] * 2


async def test_a_cancelled_start_waits_at_most_its_timeout(fake, autojump_clock):
    fake.hang()
    start = trio.current_time()
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(ConfigError, match="has not returned within 2 s"):
            await trioserve._ray_connect.start_ray(RayConfig(start_timeout_s=2.0))
    assert trio.current_time() - start == 2.0


async def test_a_hung_ray_shutdown_holds_the_close_at_most_its_bound_and_no_lock(
    fake, mock_clock, caplog
):
    """The last runtime's stop waits for ray.shutdown at most STOP_TIMEOUT_S, holding
    no lock meanwhile; a start meanwhile waits for the shutdown (no ray.init runs
    beside it) within its own timeout, and says why it failed.

    The clock jumps only once the Ray thread is where the test puts it: an
    autojumping clock would pass the start's timeout while ray.init's thread runs
    (it connects at once), and the stop's bound before the thread began the
    shutdown."""
    caplog.set_level(logging.ERROR, logger="trioserve")
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    fake.hang_shutdown()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trioserve._ray_connect.stop_ray)
        assert await trio.to_thread.run_sync(fake.stopping.wait, GATE_LIMIT_S)
        mock_clock.autojump_threshold = 0  # the shutdown hangs: the stop's bound passes
    assert trio.current_time() - start == trioserve._ray_connect.STOP_TIMEOUT_S
    assert fake.stopping.is_set()  # (and it still hangs)
    assert [r.getMessage() for r in caplog.records] == [
        "ray.shutdown() has not returned within 30 s of the close: the runtime closes "
        "without waiting for it (it is left to finish in its thread; Ray is connected "
        "again in this process only once it has returned)"
    ]
    assert trioserve._ray_connect._users_lock.acquire(blocking=False)
    trioserve._ray_connect._users_lock.release()
    users, owner, connecting, stopping = _state()
    assert (users, owner, connecting) == (0, None, None)
    assert stopping is not None
    assert not stopping.ended
    start = trio.current_time()
    with pytest.raises(ConfigError) as info:
        await trioserve._ray_connect.start_ray(RayConfig(start_timeout_s=3.0))
    assert trio.current_time() - start == 3.0
    assert str(info.value) == (
        "ray.start_timeout_s: cannot connect to a local Ray (ray.address is not set: one "
        "is started in this process): the ray.shutdown of the Ray this process connected "
        "before has not returned within 3 s"
    )
    assert fake.calls == ["init", "shutdown"]
    fake.stopped.set()
    await trio.to_thread.run_sync(stopping.join)
    assert _state() == (0, None, None, None)


async def test_a_start_while_ray_shutdown_runs_waits_for_it_then_connects(fake):
    """Another runtime of the process starts while the last one's ray.shutdown runs:
    it connects once the shutdown has returned, never beside it."""
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    fake.hang_shutdown()
    results = []

    async def stop() -> None:
        await trioserve._ray_connect.stop_ray()
        results.append("stopped")

    async def start() -> None:
        await trio.to_thread.run_sync(fake.stopping.wait, GATE_LIMIT_S)
        results.append(await trioserve._ray_connect.start_ray(RayConfig()))

    with pytest.MonkeyPatch.context() as mp:
        waiters, both_wait = watch_waits(mp, "on_ended", 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop)
            nursery.start_soon(start)
            await both_wait.wait()  # the stop and the start wait for the shutdown
            assert waiters[0] is waiters[1]
            assert trioserve._ray_connect._connecting is None  # no ray.init beside it
            assert fake.calls == ["init", "shutdown"]
            fake.stopped.set()
    assert sorted(results, key=str) == [True, "stopped"]
    assert fake.calls == ["init", "shutdown", "init"]
    assert fake.connected
    assert trioserve._ray_connect._users == 1
    await trioserve._ray_connect.stop_ray()
    assert fake.calls == ["init", "shutdown", "init", "shutdown"]
    assert _state() == (0, None, None, None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "ray.start_timeout_s: must be a finite number > 0.0, got 0"),
        (3601, "ray.start_timeout_s: must be a finite number <= 3600.0, got 3601"),
        ("1m", "ray.start_timeout_s: must be a finite number > 0.0, got '1m'"),
    ],
)
def test_a_bad_start_timeout_is_a_config_error(value, message):
    with pytest.raises(ConfigError) as info:
        trioserve.config_from_mapping(
            {"models": {"m": {"backend": "echo"}}, "ray": {"start_timeout_s": value}}
        )
    assert str(info.value) == message


def test_the_start_timeout_defaults_to_two_minutes():
    assert RayConfig().start_timeout_s == 120.0
