"""``serve_in_thread``: the runtime on a background trio thread, for blocking code."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import trio

from ._config import Config
from ._config_file import given_config
from ._errors import ActorClosed, DeadlineExceeded, InvalidInput, TrioserveError
from ._front import Runtime
from ._model import item_list
from ._runtime import open_runtime


class Client:
    """A blocking, thread-safe handle on a runtime running in another thread."""

    def __init__(self, runtime: Runtime, token: trio.lowlevel.TrioToken) -> None:
        self.runtime = runtime
        self._token = token

    def infer(
        self,
        model: str,
        inputs: Any,
        *,
        tenant: str | None = None,
        priority: str | int | None = None,
        version: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Blocking ``Runtime.infer``; ``timeout`` (seconds, > 0) raises
        DeadlineExceeded."""
        _check_timeout(timeout)
        return self._call(self._one, model, inputs, tenant, priority, version, timeout)

    def infer_many(
        self,
        model: str,
        inputs: Sequence[Any],
        *,
        tenant: str | None = None,
        priority: str | int | None = None,
        version: str | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run every item concurrently; return the results in input order.

        With ``return_exceptions`` a failed item's exception takes its place in the
        list; otherwise the first failure (in input order) is raised once all are done.
        """
        _check_timeout(timeout)
        items = list(item_list(model, inputs, "infer_many", stacked=False))
        results = self._call(self._many, model, items, tenant, priority, version, timeout)
        if not return_exceptions:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        return results

    def statistics(self) -> dict[str, Any]:
        """``Runtime.statistics()``, read in the runtime's thread."""
        return self._call(self._read, "statistics")

    def tenant_statistics(self) -> dict[str, dict[str, Any]]:
        """``Runtime.tenant_statistics()`` (credits), read in the runtime's thread."""
        return self._call(self._read, "tenant_statistics")

    def cache_statistics(self) -> dict[str, Any]:
        """``Runtime.cache_statistics()`` (with the cache off: the coalescing counters
        when a model coalesces, else {})."""
        return self._call(self._read, "cache_statistics")

    def health(self) -> dict[str, Any]:
        """``Runtime.health()``: per model, whether it is ready and each replica's
        health (``ready``, ``half_open``, ``open``, ...), read in the runtime's
        thread."""
        return self._call(self._read, "health")

    def invalidate_cache(self, model: str, version: str | None = None) -> int:
        """``Runtime.invalidate_cache()``: drop the model's cached results (of one
        version if given) and return how many, in the runtime's thread."""
        return self._call(self._read, "invalidate_cache", model, version)

    def load_model(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Blocking ``Runtime.load_model`` (explicit model control): load or reload
        ``model`` (with ``config``'s keys laid over its table, for this load);
        returns once the new copy serves."""
        self._call(self._await, "load_model", model, config)

    def unload_model(self, model: str) -> None:
        """Blocking ``Runtime.unload_model``: returns once the model is unloaded
        (its admitted requests answered, its replicas released)."""
        self._call(self._await, "unload_model", model)

    def model_state(self, model: str) -> tuple[str, str]:
        """``Runtime.model_state()``: READY, UNAVAILABLE, LOADING or UNLOADING, and
        why, read in the runtime's thread."""
        return self._call(self._read, "model_state", model)

    def rollout_state(self, model: str) -> dict[str, Any]:
        """``Runtime.rollout_state()``: the model's rollout now, read in the
        runtime's thread."""
        return self._call(self._read, "rollout_state", model)

    def promote(self, model: str) -> dict[str, Any]:
        """``Runtime.promote()``: promote the model's canary now; its new state."""
        return self._call(self._read, "promote", model)

    def rollback(self, model: str, reason: str = "operator") -> dict[str, Any]:
        """``Runtime.rollback()``: roll the model's canary back now, for ``reason``;
        its new state."""
        return self._call(self._read, "rollback", model, reason)

    def pause_rollout(self, model: str) -> dict[str, Any]:
        """``Runtime.pause_rollout()``: hold the model's canary at its step; its new
        state."""
        return self._call(self._read, "pause_rollout", model)

    def resume_rollout(self, model: str) -> dict[str, Any]:
        """``Runtime.resume_rollout()``: resume the model's paused canary; its new
        state."""
        return self._call(self._read, "resume_rollout", model)

    def start_rollout(self, model: str, *, canary: str, **rule: Any) -> dict[str, Any]:
        """``Runtime.start_rollout()``: begin a new trial of ``canary`` (with
        ``rule``'s overrides of the rollout's rule keys); its new state."""
        return self._call(self._start_rollout, model, canary, rule)

    async def _start_rollout(self, model: str, canary: str, rule: dict[str, Any]) -> Any:
        self._check_open()
        return self.runtime.start_rollout(model, canary=canary, **rule)

    # ---- trio side
    def _call(self, fn: Any, *args: Any) -> Any:
        if trio.lowlevel.in_trio_task():
            raise RuntimeError(
                "the blocking client was called by a trio task, whose thread it would "
                "block: call it in trio.to_thread.run_sync"
            )
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ActorClosed("the runtime is shut down") from None
        except (trio.Cancelled, BaseExceptionGroup) as exc:
            # Calls run as trio system tasks, which trio cancels once the runtime's
            # main task has returned: a call still waiting then (for its tenant's
            # credits, say) ends in Cancelled. In this thread that cancels nothing of
            # ours; it is the shutdown overtaking the call.
            if isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is not None:
                raise
            raise ActorClosed("the runtime shut down before this call was answered") from None

    def _check_open(self) -> None:
        """Refuse a call that arrives once the runtime is closing, before it yields:
        after the runtime's main task has returned, trio runs the call cancelled, and
        its first checkpoint would raise Cancelled instead of ActorClosed."""
        if self.runtime.closed:
            raise ActorClosed("the runtime is shut down")

    async def _read(self, name: str, *args: Any) -> Any:
        self._check_open()
        return getattr(self.runtime, name)(*args)

    async def _await(self, name: str, *args: Any) -> Any:
        self._check_open()
        return await getattr(self.runtime, name)(*args)

    async def _one(
        self, model: str, inputs: Any, tenant: Any, priority: Any, version: Any,
        limit: float | None,
    ) -> dict[str, Any]:
        # ``limit`` is the blocking caller's timeout, turned into a cancel scope here.
        self._check_open()
        infer = self.runtime.infer
        if limit is None:
            return await infer(model, inputs, tenant=tenant, priority=priority, version=version)
        with trio.move_on_after(limit):
            return await infer(model, inputs, tenant=tenant, priority=priority, version=version)
        raise DeadlineExceeded(f"model {model!r}: no answer within {limit:g}s")

    async def _many(
        self, model: str, items: list[Any], tenant: Any, priority: Any, version: Any,
        limit: float | None,
    ) -> list[Any]:
        self._check_open()
        rt = self.runtime
        window = len(items)
        try:
            served = rt._served(model, version)
            name, _ = rt._classify(tenant, priority)
        except TrioserveError:
            pass  # each item is answered with it, in its place
        else:
            window = _window(served, name)
        # At most ``window`` items in flight: submitted all at once, a long call's own
        # items filled the queue and those past it were answered Overloaded, whatever
        # the load. ``limit`` bounds the whole call, the wait for the window included.
        room = trio.CapacityLimiter(max(1, min(window, len(items))))
        deadline = math.inf if limit is None else trio.current_time() + limit
        results: list[Any] = [None] * len(items)

        async def one(i: int) -> None:
            try:
                with trio.move_on_at(deadline):
                    async with room:
                        results[i] = await rt.infer(
                            model, items[i], tenant=tenant, priority=priority,
                            version=version,
                        )
                        return
                raise DeadlineExceeded(f"model {model!r}: no answer within {limit:g}s")
            except Exception as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(len(items)):
                nursery.start_soon(one, i)
        return results


def _window(served: Any, tenant: str) -> int:
    """How many items of one ``infer_many`` call are in flight at once: enough to keep
    each replica's next batches full (four batches a replica), and never more than the
    tenant may queue (its ``queue_share`` of ``runtime.queue_bound``)."""
    cfg = served.config
    ahead = 4 * cfg.max_batch_size * max(1, len(served.batchers))
    return max(1, min(ahead, served.scheduler.policy.most_queued(tenant)))


def _check_timeout(timeout: float | None) -> None:
    # a bool is an int to Python: True was taken as one second
    if timeout is not None and not (isinstance(timeout, int | float)
                                    and not isinstance(timeout, bool)
                                    and timeout > 0 and math.isfinite(timeout)):
        raise InvalidInput(f"timeout must be a positive number of seconds, got {timeout!r}")


def serve_in_thread(config: Config | None = None) -> _ServeInThread:
    """Run the runtime on a background trio thread; yield a blocking :class:`Client`.

    Leaving the block shuts the runtime down: requests in flight are answered or
    failed (ActorClosed), and later calls raise ActorClosed, as does a call that the
    shutdown overtakes. Never hangs. An interrupt (Ctrl-C) while it starts stops the
    start, then is raised: no runtime is left behind. The object it returns is
    entered once (``with``): entering it again is a RuntimeError (which says when its
    first entry failed, and with what type of error).
    """
    return _ServeInThread(config)


class _ServeInThread:
    """What :func:`serve_in_thread` returns: a context manager entered once."""

    def __init__(self, config: Config | None) -> None:
        self._config = config
        self._cm: Any = None
        #: the type name of the error its first entry raised (None: it did not fail)
        self._failed: str | None = None

    def __enter__(self) -> Client:
        if self._failed is not None:
            raise RuntimeError(
                "this serve_in_thread(...) was entered already, and that entry failed "
                f"({self._failed}: see its error): it is entered once; call "
                "serve_in_thread(config) again for another runtime"
            )
        if self._cm is not None:
            raise RuntimeError(
                "this serve_in_thread(...) was entered already: it is entered once (its "
                "runtime runs for one `with` block); call serve_in_thread(config) again "
                "for another runtime"
            )
        self._cm = _serve_in_thread(self._config)
        try:
            return self._cm.__enter__()
        except BaseException as exc:
            self._failed = type(exc).__name__
            raise

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._cm.__exit__(*exc_info)


@contextmanager
def _serve_in_thread(config: Config | None) -> Iterator[Client]:
    """:func:`serve_in_thread`'s block."""
    config = given_config(config, "serve_in_thread")  # refused here, not in its thread
    if trio.lowlevel.in_trio_task():
        # Its exit would have to block this task's thread until the runtime stops:
        # trio refuses that, and the runtime was left running.
        raise RuntimeError(
            "serve_in_thread is for blocking code, and was called by a trio task: in a "
            "trio program use `async with trioserve.open_runtime(config) as rt`"
        )
    ready = threading.Event()
    abandoned = threading.Event()  # the caller left while it started
    box: dict[str, Any] = {}

    async def main() -> None:
        with trio.CancelScope() as start:
            box["start"] = start
            box["token"] = trio.lowlevel.current_trio_token()
            if abandoned.is_set():  # before the token was there to reach it
                start.cancel("the caller left while the runtime started")
            async with open_runtime(config) as rt:
                stop = trio.Event()
                box["client"] = Client(rt, box["token"])
                box["stop"] = stop
                ready.set()
                await stop.wait()

    def leave() -> None:
        """In the runtime's thread: stop the runtime, or its start."""
        if "stop" in box:
            box["stop"].set()  # started: closed as the block's end closes it
        else:
            box["start"].cancel("the caller left while the runtime started")

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the starting thread below
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=thread_main, name="trioserve-runtime", daemon=True)
    try:
        # (start() inside: a Ctrl-C may land as it returns, the runtime thread
        # already running on to load the models)
        thread.start()
        ready.wait()
    except BaseException:
        # A Ctrl-C (KeyboardInterrupt) while the models load: the start is stopped
        # and waited for, not left to load and serve with nobody to stop it.
        abandoned.set()
        if "token" in box:  # else main() sees ``abandoned`` as it begins
            try:
                trio.from_thread.run_sync(leave, trio_token=box["token"])
            except trio.RunFinishedError:
                pass
        try:
            thread.join()
        except RuntimeError:
            pass  # it had not begun: main() sees ``abandoned`` as it begins
        raise
    if "client" not in box:
        thread.join()
        raise box["error"]
    client: Client = box["client"]
    try:
        yield client
    finally:
        try:
            trio.from_thread.run_sync(box["stop"].set, trio_token=client._token)
        except trio.RunFinishedError:
            pass
        thread.join()
        if "error" in box:
            raise box["error"]
