"""The CLI's network entry points: ``trioserve serve`` and ``trioserve bench --url``."""

from __future__ import annotations

import errno
import gc
import logging
import math
import os
import shlex
import signal
import sys
import traceback
from typing import Any
from urllib.parse import quote

import attrs
import trio
import trio_websocket
import trioserve
from trioserve import (
    Config,
    ConfigError,
    ModelConfig,
    ModelLoadError,
    Runtime,
    load_config,
    open_runtime,
)
from trioserve._builtin import warm_imports

from ._gateway import Gateway, open_gateway
from ._listeners import open_listeners
from ._loading import LoadingAnswers
from ._request import sample_inputs
from ._v2 import dumps

# ---------------------------------------------------------------- serve


def serve_main(
    config_path: str | None = None, host: str | None = None, port: int | None = None
) -> int:
    """Load the config (None: the built-in one), serve it until SIGINT or SIGTERM,
    then (after ``server.drain_delay_s``, not ready meanwhile) drain within
    ``runtime.graceful_timeout_s`` and return 0. A second signal stops at once."""
    config = load_config(config_path)
    try:
        with _progress_shown():
            return trio.run(serve, config, host, port)
    except BaseExceptionGroup as group:
        # serve's nursery wraps what opening the runtime raises; a configuration
        # found wrong as the runtime starts (a backend's options) is reported as such
        wrong, rest = group.split(ConfigError)
        if wrong is not None and rest is None:
            raise _leaf(wrong) from None
        failed, rest = group.split(ModelLoadError)
        if failed is not None and rest is None:
            return _cannot_load(_leaf(failed))
        raise
    except ModelLoadError as exc:
        return _cannot_load(exc)
    except _CannotListen as exc:
        return _cannot_listen(exc.error, config, host, port)


class _CannotListen(OSError):
    """Binding the address failed (``error``, whose errno and text it has): only
    this is reported as "cannot listen". Another OSError while serving (the banner
    written to a closed pipe) was reported so too, naming the address it listened on."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.errno, error.strerror or str(error))
        self.error = error


class _progress_shown:
    """While serving: the runtime's progress (models loading, ready) on stdout as
    ``trioserve: ...`` lines; its warnings and errors on stderr as
    ``trioserve: WARNING: ...`` (``ERROR``) lines."""

    def __enter__(self) -> None:
        logger = logging.getLogger("trioserve")
        self._before = logger.level
        self._handler = handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("trioserve: %(message)s"))
        handler.addFilter(lambda record: record.levelno < logging.WARNING)
        self._warnings = warnings = logging.StreamHandler()  # stderr
        warnings.setLevel(logging.WARNING)
        # named and ranked, as every other line the command writes is named
        warnings.setFormatter(logging.Formatter("trioserve: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.addHandler(warnings)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("trioserve")
        logger.removeHandler(self._handler)
        logger.removeHandler(self._warnings)
        logger.setLevel(self._before)


def _cannot_load(exc: BaseException) -> int:
    """A model failed to load: the traceback of the backend's code (none of the
    runtime's frames; none at all when it has no frame there: a worker process or
    a Ray actor that died or could not be placed), then one line saying which
    replica and why."""
    cause = exc.__cause__
    details = getattr(cause, "details", None)  # a worker process's
    if details:
        print(details.rstrip(), file=sys.stderr)
    elif cause is not None:
        tb = cause.__traceback__
        while tb is not None and _runtime_frame(tb.tb_frame):
            tb = tb.tb_next
        if tb is not None:
            traceback.print_exception(type(cause), cause, tb, file=sys.stderr)
    print(f"trioserve: {exc}", file=sys.stderr)
    return 1


def _runtime_frame(frame: Any) -> bool:
    return frame.f_globals.get("__name__", "").partition(".")[0] in (
        "trioserve", "trio", "outcome",
    )


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _cannot_listen(
    exc: OSError, config: Config, host: str | None, port: int | None
) -> int:
    """Listening failed (address in use, ...): say so without a traceback."""
    name = host if host is not None else config.server.host
    where = (
        f"{f'[{name}]' if ':' in name else name}:"  # an IPv6 address, as in a URL
        f"{port if port is not None else config.server.port}"
    )
    hint = _LISTEN_HINTS.get(exc.errno, "")
    print(f"trioserve: cannot listen on {where}: {exc}{hint}", file=sys.stderr)
    return 1


#: What to do when binding fails so (the address is in the message before it).
_LISTEN_HINTS = {
    errno.EADDRINUSE: " (another process listens there: stop it, or pick another port "
    "with --port or [server] port; 0 takes a free one)",
    errno.EACCES: " (a port below 1024 needs privileges: pick another with --port or "
    "[server] port)",
    errno.EADDRNOTAVAIL: " (no interface of this machine has that address: pick another "
    "with --host or [server] host)",
}


#: Allocations between two collections of the young generation while serving.
GC_YOUNG_THRESHOLD = 50_000


def settle_memory() -> None:
    """Tune the cyclic GC for serving, once the models are loaded.

    Everything loaded so far (torch, models, tokenizers) lives as long as the server:
    it is kept out of the cyclic GC, whose full passes over it would otherwise stall
    the event loop for tens of milliseconds. And requests allocate a few hundred
    tracked objects each (items, requests, replies): at the default threshold (700) a
    young collection ran every few requests, ~4% of the loop under ``[32, 256]``
    requests; ~1% at GC_YOUNG_THRESHOLD. Each such collection costs about the same
    (it walks what is alive, i.e. the requests in flight), so fewer is cheaper.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def serve(config: Config, host: str | None = None, port: int | None = None) -> int:
    """Serve ``config`` until SIGINT/SIGTERM; drain; return 0.

    The address is bound first, so that one in use fails at once, not after the
    models have loaded; while they load it answers probes (live, not ready) and
    every other request 503 (``._loading``); the gateway takes it over once they
    have. A signal while they load stops the start (a load in a thread is abandoned,
    a worker process killed), as a second signal stops a shutdown. On the first
    signal readiness answers 503 for ``server.drain_delay_s`` while the gateway
    serves on; then the grace (``runtime.graceful_timeout_s``) is counted once: the
    gateway's drain and the runtime's close (a model call cut off in a worker thread
    included) share it. A second signal, at any point of the shutdown (the delay
    included), stops at once (still 0: the stop was asked for).
    """
    grace = config.runtime.graceful_timeout_s
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            listeners = await open_listeners(config.server, host, port)
        except OSError as exc:
            raise _CannotListen(exc) from exc
        try:
            stop = _Stop(grace=grace, delay=config.server.drain_delay_s)
            # The watcher of signals outlives the runtime's close, so that a second
            # signal can end that too.
            async with trio.open_nursery() as watching:
                watching.start_soon(_watch_signals, signals, stop, watching.cancel_scope)
                # Until the gateway serves, probes get answers (live, not ready).
                loading = LoadingAnswers(listeners, config.server)
                await watching.start(loading.run)
                # The built-in backends' imports (seconds, for minilm) in a thread: on
                # the event loop they kept a signal unheard until they were done.
                await trio.to_thread.run_sync(
                    warm_imports, config.models, abandon_on_cancel=True
                )
                async with open_runtime(config) as rt:
                    stop.runtime = rt  # loaded: from now on a signal drains
                    await loading.hand_over()
                    async with open_gateway(
                        rt, config=config, listeners=listeners
                    ) as gateway:
                        settle_memory()
                        print(banner(gateway), flush=True)
                        await stop.asked.wait()
                        # leaving the block answers not ready for the drain delay,
                        # then drains within the grace
                        rt.grace_deadline = trio.current_time() + stop.delay + grace
                watching.cancel_scope.cancel("stopped")
            print("trioserve: stopped", flush=True)
        finally:
            with trio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()
    return 0


@attrs.define(eq=False)
class _Stop:
    """What a signal does to ``serve``: while the models load, it stops the start;
    then the first one drains (after the drain delay) and a second one stops at once."""

    grace: float
    #: ``server.drain_delay_s``: not ready this long before the drain begins
    delay: float = 0.0
    runtime: Runtime | None = None  # set once the models have loaded
    asked: trio.Event = attrs.Factory(trio.Event)


async def _watch_signals(signals: Any, stop: _Stop, scope: trio.CancelScope) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        rt = stop.runtime
        if rt is None:
            print(f"trioserve: {name} while the models load: stopping", flush=True)
        elif not stop.asked.is_set():
            delay = (
                f"not ready for {stop.delay:g} s (server.drain_delay_s), then "
                if stop.delay else ""
            )
            print(
                f"trioserve: {name}: {delay}draining "
                f"(up to {stop.grace:g} s; signal again to stop now)",
                flush=True,
            )
            stop.asked.set()
            continue
        else:
            print(f"trioserve: {name} again: stopping now", flush=True)
            # Ends the runtime's waits (a shielded one for a model thread included) ...
            rt.grace_deadline = -math.inf
        # ... and everything else: the load, the gateway's drain, the runtime's close.
        scope.cancel(f"{name}: stop")
        return


def banner(gateway: Gateway) -> str:
    """Where the gateway listens, and a curl line to paste (with an API key to fill
    in when no tenant takes requests without one)."""
    url = gateway.url
    models = gateway.runtime.models
    # under explicit model control a configured model may not be loaded yet
    loaded = [n for n in gateway.signatures if getattr(models.get(n), "loaded", True)]
    idle = [n for n in gateway.signatures if n not in loaded]
    lines = [
        f"trioserve {trioserve.__version__}: serving {', '.join(loaded) or 'no model'} on {url}",
        f"  v2 REST at {url}/v2, WebSocket stream at {url.replace('http', 'ws', 1)}/v2/stream, "
        f"metrics at {url}/metrics",
    ]
    if idle:
        lines.append(
            f"  not loaded: {', '.join(idle)} (load one with POST "
            f"{url}/v2/repository/models/NAME/load)"
        )
    if not loaded:
        return "\n".join(lines)
    name = "mlp" if "mlp" in loaded else loaded[0]
    sig = gateway.signatures[name]
    if name == "mlp" and sig.by_name.get("x") is not None and sig.by_name["x"].shape == (256,):
        data = "['\"$(python3 -c 'print(\",\".join([\"0.5\"]*256))')\"']"
        body = ("'{\"inputs\":[{\"name\":\"x\",\"shape\":[1,256],\"datatype\":\"FP32\","
                "\"data\":" + data + "}]}'")
    else:
        body = shlex.quote(
            dumps({"inputs": sample_inputs(name, sig.inputs, 1, literal=True)}).decode()
        )
    keyless = any(t.default for t in gateway.config.tenants)
    lines.append("  try it:" if keyless else "  try it, with one of a tenant's api_keys for KEY:")
    auth = "" if keyless else "-H 'Authorization: Bearer KEY' "
    lines.append(
        # A name is any path segment: encoded, so a space, "?" or "#" stays in it.
        f"    curl -s {url}/v2/models/{quote(name, safe='')}/infer "
        f"-H 'Content-Type: application/json' {auth}-d {body}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- bench --url
def bench_http_main(args: Any) -> int:
    """``trioserve bench --url``: closed-loop load over HTTP (C keep-alive connections)
    or over one WebSocket stream (``--stream``, C requests in flight); prints the same
    report as the in-process bench and writes the figures as JSON."""
    from trioserve._bench import (
        _answered_any,
        format_report,
        no_offline_note,
        offline_throughput,
        write_json,
    )

    from ._bench import bench_http

    offline = note = builtin = None
    if not getattr(args, "no_offline", False):
        try:  # a built-in model of that name: its offline limit is measured here
            builtin = ModelConfig(name=args.model, backend=args.model)
        except ConfigError:
            builtin = None
        if builtin is not None:
            note = no_offline_note(builtin)
    try:
        res = trio.run(
            lambda: bench_http(
                args.url,
                model=args.model,
                concurrency=args.concurrency or 64,
                duration=args.duration or 10.0,
                warmup=args.warmup,
                batch_dim=max(1, args.batch_dim),
                stream=args.stream,
                api_key=getattr(args, "api_key", None),
                progress=os.isatty(2),
            )
        )
    except (OSError, BaseExceptionGroup) as exc:
        # The server cannot be reached (refused, no such host): say so in a line.
        if isinstance(exc, BaseExceptionGroup):
            matched, rest = exc.split(OSError)
            if matched is None or rest is not None:
                raise
            while isinstance(exc, BaseExceptionGroup):
                exc = exc.exceptions[0]
        print(f"trioserve: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    except trio_websocket.ConnectionRejected as exc:
        key = ("" if getattr(args, "api_key", None)
               else "; a server with no open tenant needs --api-key")
        print(
            f"trioserve: {args.url} refused the stream: HTTP {exc.status_code}{key}",
            file=sys.stderr,
        )
        return 1
    if builtin is not None and note is None and res["requests"]:
        # Once the server has answered: the offline loop loads the model here (for
        # a torch model, torch's import alone takes seconds), which a bench that
        # cannot reach the server, or one it answers with errors only, does not need.
        offline = offline_throughput(builtin)
        # the server's model may differ (its config, its machine)
        offline["where"] = f"the built-in {args.model!r} at its defaults, on this machine"
    if offline:
        res["offline"] = offline
        res["served_over_offline"] = res["items_per_s"] / offline["items_per_s"]
    elif note:
        res["offline_note"] = note
    print(format_report(res))
    if res["batch_dim"] > 1 or res["mode"] == "websocket":
        print(f"  items/s        {res['items_per_s']:,.0f}  ({res['batch_dim']} per request)")
    path = args.json or f"bench-results/bench-{res['mode']}-{res['model']}.json"
    print(f"  json           {write_json(res, path)}")
    code = _answered_any(res)
    if code and res.get("error_kinds", {}).get("Unauthorized"):
        print(
            "trioserve: the server wants an API key: pass a tenant's with --api-key"
            if not getattr(args, "api_key", None)
            else "trioserve: the server refused the API key given with --api-key",
            file=sys.stderr,
        )
    return code
