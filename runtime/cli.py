"""The ``trioserve`` command: ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from . import _early_signals
from ._config import EXECUTIONS
from ._config_file import in_file
from ._errors import ConfigError
from .scenarios import SCENARIOS, run_scenario


def _number(kind: type, *, low: float, low_ok: bool = True, high: float | None = None) -> Any:
    """An argparse type: a ``kind`` number at or above ``low`` (above it, unless
    ``low_ok``), at most ``high``; a bad one is a usage error (exit status 2)."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < low or (v == low and not low_ok) or (
            high is not None and v > high
        ):
            bound = f"{'at least' if low_ok else 'above'} {low:g}"
            if high is not None:
                bound += f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return v

    return parse


def _host(text: str) -> str:
    """A listen address; an IPv6 one may come in brackets, as URLs (and the banner)
    write it: ``[::1]`` is ``::1``."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be an address or host name, got nothing")
    if text.startswith("[") and text.endswith("]") and ":" in text:
        return text[1:-1]
    return text


def _file(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a TOML file, got nothing")
    return text


_PORT = _number(int, low=0, high=65535)
_COUNT = _number(int, low=1)
_SECONDS = _number(float, low=0.0, low_ok=False)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is one line: what was wrong and where the
    options are listed. argparse printed the usage synopsis above it, a dozen lines
    for ``bench`` (its scenarios listed), with the one line that matters last."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trioserve",
        description="Serve models over HTTP and WebSocket (serve), or measure them (bench).",
        epilog="Each command has its own --help. Docs: README.md and docs/.",
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"trioserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the configured models over HTTP and WebSocket")
    s.add_argument("--config", type=_file,
                   help="TOML config file (default: the built-in configuration)")
    s.add_argument("--host", type=_host,
                   help="listen address, an IPv6 one bare or in brackets; :: takes IPv4 "
                   "clients too (default: the config's [server] host, 127.0.0.1)")
    s.add_argument("--port", type=_PORT,
                   help="listen port, 0-65535 (default: the config's [server] port, 8000)")

    b = sub.add_parser("bench", help="closed-loop load, in process or against --url")
    b.add_argument("--config", type=_file,
                   help="TOML config file, in process (default: the built-in configuration)")
    b.add_argument("--url", help="bench a running server over HTTP instead of in process")
    b.add_argument("--model", default="mlp", help="the model to bench (default mlp)")
    b.add_argument("-c", "--concurrency", type=_COUNT, default=None,
                   help="concurrent callers (default 256 in process, 64 over HTTP)")
    b.add_argument("-d", "--duration", type=_SECONDS, default=None,
                   help="seconds measured (default 10; a scenario has its own)")
    b.add_argument("--warmup", type=_number(float, low=0.0), default=2.0,
                   help="seconds of load before the measurement (default 2)")
    b.add_argument("--replicas", type=_COUNT, help="in process: the model's replicas")
    b.add_argument("--max-batch-size", type=_COUNT, help="in process: the model's max_batch_size")
    b.add_argument("--max-wait-ms", type=_number(float, low=0.0),
                   help="in process: the model's max_wait_ms")
    b.add_argument("--torch-threads", type=_COUNT, help="in process: the model's torch_threads")
    b.add_argument("--execution", choices=EXECUTIONS,
                   help="in process: where the model runs (default: the model's own choice)")
    b.add_argument("--batch-dim", type=_COUNT, default=1,
                   help="items per HTTP request (shape [N, ...]); --url only")
    b.add_argument("--stream", action="store_true", help="--url only: use the WebSocket stream")
    b.add_argument("--api-key", help="--url only: the tenant's API key, sent as "
                   "'Authorization: Bearer KEY' (default: none, the open tenant's)")
    b.add_argument("--no-offline", action="store_true", help="skip the offline measurement")
    b.add_argument("--json", help="write the figures here (default bench-results/)")
    b.add_argument("--scenario", choices=sorted(SCENARIOS),
                   help="run a named scenario instead of plain load (its own configuration "
                   "and load: of the options above only -d and --json apply): "
                   + "; ".join(f"{k}: {v[1]}" for k, v in sorted(SCENARIOS.items()))
                   .replace("%", "%%"))  # argparse formats help with %
    return p


#: bench options that act in process only (dest, as typed)
_IN_PROCESS = (("config", "--config"), ("replicas", "--replicas"),
               ("max_batch_size", "--max-batch-size"), ("max_wait_ms", "--max-wait-ms"),
               ("torch_threads", "--torch-threads"), ("execution", "--execution"))
#: bench options that act over HTTP only
_URL_ONLY = (("batch_dim", "--batch-dim"), ("stream", "--stream"), ("api_key", "--api-key"))


def _misplaced(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Why a ``bench`` option given has no effect where it is given, or None: a
    scenario brings its own configuration and load, ``--url`` benches the server's
    configuration, and some options shape the HTTP load only. Silently ignored, the
    figures would be read as the option's."""
    defaults = vars(parser.parse_args(["bench"]))

    def given(dest: str) -> bool:
        return getattr(args, dest) != defaults[dest]

    if args.scenario:
        allowed = {"scenario", "json", "command"}
        if args.scenario != "cache":
            allowed.add("duration")
        for dest in vars(args):
            if dest not in allowed and given(dest):
                flag = "-d" if dest == "duration" else "--" + dest.replace("_", "-")
                why = ("its traces are fixed" if dest == "duration"
                       else "it brings its own configuration and load; only -d and --json apply")
                return f"{flag} does not apply to --scenario {args.scenario}: {why}"
        return None
    if args.url:
        for dest, flag in _IN_PROCESS:
            if given(dest):
                return (f"{flag} acts in process only: with --url the server's own "
                        "configuration applies")
        return None
    for dest, flag in _URL_ONLY:
        if given(dest):
            return f"{flag} applies with --url only"
    return None


def _unwritable(path: str) -> str | None:
    """Why the figures could not be written to ``path`` (``bench --json``), or None.
    Checked before the load runs: found when it was written, a bad path cost the
    whole run (a traceback after the report). Creates the folders the bench would
    create; leaves no file behind."""
    out = Path(path)
    if out.is_dir():
        return "is a folder: name a file"
    existed = out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a"):
            pass
    except OSError as exc:
        return f"cannot write there: {exc.strerror or exc}"
    if not existed:
        out.unlink()
    return None


def main(argv: list[str] | None = None) -> int:
    _early_signals.hold()  # (held since the package's import when run as the command)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        why = _misplaced(parser, args)
        if why is None and args.json:
            why = _unwritable(args.json)
            why = why and f"--json {args.json}: {why}"
        if why is not None:
            parser.exit(2, f"{parser.prog}: error: bench: {why}; see {parser.prog} bench --help\n")
    try:
        _early_signals.release(serving=args.command == "serve")
        if args.command == "serve":
            from trioserve.transport import serve_main

            try:
                return serve_main(config_path=args.config, host=args.host, port=args.port)
            finally:
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # served: as before
        if args.command == "bench" and args.scenario:
            return run_scenario(args.scenario, args)
        if args.command == "bench":
            if args.url:
                from trioserve.transport import bench_http_main

                return bench_http_main(args)
            from ._bench import BenchSpec, main_in_process

            spec = BenchSpec(
                model=args.model,
                concurrency=args.concurrency or 256,
                duration=args.duration or 10.0,
                warmup=args.warmup,
                replicas=args.replicas,
                max_batch_size=args.max_batch_size,
                max_wait_ms=args.max_wait_ms,
                torch_threads=args.torch_threads,
                execution=args.execution,
                offline=not args.no_offline,
            )
            return main_in_process(spec, args.config, args.json)
    except ConfigError as exc:
        from ._bench import NoOpenTenant, UnknownBenchModel

        if isinstance(exc, NoOpenTenant):  # a valid file the bench cannot call
            print(f"trioserve: bench: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, UnknownBenchModel):  # --model, not the file, is wrong
            print(f"trioserve: {exc}", file=sys.stderr)
            return 2
        if args.command == "serve":  # every value serve checks is the file's
            exc = in_file(exc, args.config)
        print(f"trioserve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not _interrupted(exc):
            raise
        if args.command != "serve":
            return 130
        # Ctrl-C or SIGTERM before serve listens for signals itself (imports, the
        # config, the bind): it stops the start, as one a moment later does.
        print(f"trioserve: {_early_signals.last} while starting: stopped", flush=True)
        return 0
    return 0


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a KeyboardInterrupt, alone or in a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(KeyboardInterrupt)
        return matched is not None and rest is None
    return isinstance(exc, KeyboardInterrupt)


def _lingering() -> list[threading.Thread]:
    """Threads that would keep the process alive once the command is done: not
    daemons, started by a model (a backend factory's watcher, an inline model's
    helper) and never stopped; the interpreter would wait for them for ever."""
    main_thread = threading.main_thread()
    return [t for t in threading.enumerate() if not t.daemon and t is not main_thread]


def entry() -> None:
    """The ``trioserve`` command: :func:`main`, then exit with its status.

    A model call that outlived the runtime's grace in a worker thread (a thread cannot
    be stopped) would make the interpreter's finalisation abort the process (torch
    calls ``std::terminate`` when the thread resumes), so then the process ends at
    once, with its status, once the output is flushed. So it does when a thread a
    model started and never stopped (no daemon) would keep the process alive.
    """
    from trioserve.actors import model_threads_running

    try:
        code = main()
    except BaseException:
        if not model_threads_running() and not _lingering():
            raise
        traceback.print_exc()  # an unexpected error, with a model thread still running
        code = 1
    lingering = _lingering()
    if lingering and not model_threads_running():
        names = ", ".join(t.name for t in lingering)
        n = len(lingering)
        print(
            f"trioserve: not waiting for {n} thread{'s' if n != 1 else ''} the models "
            f"left running: {names}", file=sys.stderr,
        )
    if model_threads_running() or lingering:
        for out in (sys.stdout, sys.stderr):
            try:
                out.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
