"""The command line: ``python -m fuzz``."""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import math
import random
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ._harness import SUITES, Failure, Profile, Suite, chunk_seed, default_database, run_chunk
from ._known import strict
from ._logs import RuntimeLog, runtime_log
from ._mutants import MUTANTS
from ._selftest import catch_bug
from ._stats import EXAMPLES, EXPECTED, FEATURES

#: Without a terminal (nohup, CI logs) the progress line is printed this often.
PLAIN_PROGRESS_S = 30.0
#: A chunk of examples that runs this long (real time) is hung: dump every thread's
#: stack and exit, rather than stall a nightly run.
HUNG_CHUNK_S = 600


def _positive(text: str) -> float:
    """A finite number above 0 (argparse's ``float`` takes 0, -3, nan and inf: a run
    of 0 or fewer minutes ran no example and said it found nothing, one of nan or inf
    minutes never ended, a self-test budget of 0 let every planted bug escape)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fuzz",
        description="Property-based fuzzing of trioserve's ordering, loss and starvation "
        "invariants (docs/fuzzing.md).",
    )
    p.add_argument(
        "--minutes", type=_positive, default=1.0, help="time budget of a long run (default 1)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="the run's seed (default: random, printed)"
    )
    p.add_argument(
        "--suite",
        action="append",
        choices=[*SUITES, "all"],
        help="a suite to run (repeatable; default: all)",
    )
    p.add_argument(
        "--profile",
        choices=[p.value for p in Profile],
        default=Profile.LONG.value,
        help="long: chunks until --minutes pass, with the example database (default); "
        "ci: a fixed budget of examples per suite, seed 0, no database",
    )
    p.add_argument(
        "--self-test",
        action="store_true",
        help="run the suites against planted bugs; each must be caught",
    )
    p.add_argument(
        "--budget", type=_positive, default=60.0, help="self-test: seconds allowed per bug"
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="also check the known, not yet fixed issues (docs/fuzzing.md)",
    )
    p.add_argument("--no-database", action="store_true", help="do not read or write .hypothesis/")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # the runtime's lines for the faults the scenarios plant are counted, not shown;
    # the logger is as it was afterwards: main may run inside another program
    # (in the self-test without their tracebacks: the product is broken on purpose)
    with runtime_log(tracebacks=not args.self_test) as log:
        return _main(args, log)


def _main(args: argparse.Namespace, log: RuntimeLog) -> int:
    console = Console(stderr=False, highlight=False)
    if args.strict:
        strict()
    wanted = args.suite or ["all"]
    names = list(SUITES) if "all" in wanted else list(dict.fromkeys(wanted))
    if args.self_test:
        return _self_test(
            console, args.budget, names, 0 if args.seed is None else args.seed, log
        )
    suites = [SUITES[n] for n in names]
    profile = Profile(args.profile)
    run_seed = args.seed
    if run_seed is None:
        run_seed = 0 if profile is Profile.CI else random.SystemRandom().randrange(10**6)
    database = None if args.no_database or profile is Profile.CI else default_database()
    try:
        failure = _fuzz(console, suites, profile, args.minutes, run_seed, database, log)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 1 if failure else 0


def _watchdog() -> None:
    """(Re)arm the hang watchdog for the next chunk."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        faulthandler.dump_traceback_later(HUNG_CHUNK_S, exit=True, file=sys.__stderr__)


class _Progress:
    def __init__(self, console: Console, suites: list[Suite], budget: float | None, run_seed: int):
        self.console = console
        self.suites = suites
        self.budget = budget
        self.seed = run_seed
        self.t0 = time.monotonic()
        self.base = {s.name: EXAMPLES[s.name] for s in suites}
        self.last_plain = self.t0

    def counts(self) -> dict[str, int]:
        return {s.name: EXAMPLES[s.name] - self.base[s.name] for s in self.suites}

    def line(self) -> Text:
        elapsed = time.monotonic() - self.t0
        counts = self.counts()
        total = sum(counts.values())
        rate = total / elapsed if elapsed > 0 else 0.0
        budget = f" / {_mmss(self.budget)}" if self.budget is not None else ""
        per = "  ".join(f"{n} {c:,}" for n, c in counts.items())
        return Text(
            f"fuzz  {_mmss(elapsed)}{budget}  seed {self.seed}  |  {per}  |  "
            f"{total:,} examples, {rate:,.1f}/s"
        )

    def __rich__(self) -> Text:
        return self.line()

    def tick(self) -> None:
        if not self.console.is_terminal and time.monotonic() - self.last_plain >= PLAIN_PROGRESS_S:
            self.last_plain = time.monotonic()
            print(self.line().plain, flush=True)


def _mmss(seconds: float | None) -> str:
    s = int(seconds or 0)
    return f"{s // 60:02d}:{s % 60:02d}"


def _fuzz(
    console: Console,
    suites: list[Suite],
    profile: Profile,
    minutes: float,
    run_seed: int,
    database: object,
    log: RuntimeLog,
) -> Failure | None:
    budget = None if profile is Profile.CI else minutes * 60.0
    progress = _Progress(console, suites, budget, run_seed)
    print(
        f"fuzz: suites {', '.join(s.name for s in suites)}; profile {profile.value}; "
        f"seed {run_seed}; "
        + (f"{minutes:g} min" if budget is not None else "fixed budget")
        + ("; example database .hypothesis/examples" if database is not None else ""),
        flush=True,
    )
    failure: Failure | None = None
    live = (
        Live(progress, console=console, refresh_per_second=4, transient=False)
        if (console.is_terminal)
        else None
    )
    if live is not None:
        live.start()
    try:
        chunk = 0
        while failure is None:
            for suite in suites:
                if profile is Profile.CI:
                    n = suite.ci_examples
                else:
                    n = suite.chunk_examples
                    if time.monotonic() - progress.t0 >= budget:
                        break
                _watchdog()
                failure = run_chunk(
                    suite,
                    hypothesis_seed=chunk_seed(run_seed, suite.name, chunk),
                    max_examples=n,
                    database=database,
                    run_seed=run_seed,
                )
                progress.tick()
                if failure is not None:
                    break
            else:
                chunk += 1
                if profile is Profile.CI:
                    break
                continue
            break
    finally:
        if live is not None:
            live.stop()
    if not console.is_terminal:
        print(progress.line().plain, flush=True)
    _summary(console, progress)
    print(log.summary(), flush=True)
    if failure is not None:
        _report(failure, saved=database is not None)
    else:
        print("fuzz: no invariant broken.", flush=True)
    return failure


def _summary(console: Console, progress: _Progress) -> None:
    elapsed = time.monotonic() - progress.t0
    table = Table(title="examples", show_edge=False)
    table.add_column("suite")
    table.add_column("examples", justify="right")
    table.add_column("examples/s", justify="right")
    table.add_column("exercised")
    for name, n in progress.counts().items():
        feats = {f: 0 for f in EXPECTED.get(name, ())} | dict(FEATURES.get(name, {}))
        shown = ", ".join(f"{k} {v:,}" for k, v in sorted(feats.items()))
        table.add_row(name, f"{n:,}", f"{n / elapsed:,.1f}" if elapsed else "-", shown)
    console.print(table)


def _report(failure: Failure, *, saved: bool) -> None:
    print(
        f"\nFAILED: suite {failure.suite!r}, hypothesis seed {failure.seed} "
        f"(run seed {failure.run_seed}): {failure.message}\n",
        flush=True,
    )
    print("The shrunk reproduction, as a test to paste into tests/:\n")
    print(failure.as_pytest())
    blob = failure.blob()
    if blob:
        print(f"(hypothesis can also replay it exactly: {blob})")
    if saved:
        print(
            "The example is saved in .hypothesis/examples; the next run of this suite "
            "replays it first.",
            flush=True,
        )
    else:  # the ci profile, or --no-database
        print(
            "No example database: the example is not saved; replay it by its seed.",
            flush=True,
        )


def _self_test(
    console: Console, budget: float, names: list[str], seed: int, log: RuntimeLog
) -> int:
    """The planted bugs that the suites ``names`` can see, each against those of
    them (``--suite`` and ``--seed`` apply: they were ignored, and every bug ran
    against every suite with seed 0)."""
    bugs = {
        name: (description, [s for s in suites if s in names])
        for name, (description, _, suites) in MUTANTS.items()
        if any(s in names for s in suites)
    }
    print(
        f"fuzz --self-test: {len(bugs)} planted bugs, each against the suites that can "
        f"see it ({', '.join(names)}) until one catches it, {budget:g} s each, seed {seed}",
        flush=True,
    )
    t0 = time.monotonic()
    missed = []
    by: collections.Counter[str] = collections.Counter()
    for name, (description, suites) in bugs.items():
        print(f"{name}: {description}", flush=True)
        results = catch_bug(name, suites, budget=budget, seed=seed)
        for r in results:
            if r.caught:
                by[r.suite or ""] += 1
                print(
                    f"  caught by {r.suite:<9} in {r.seconds:5.2f} s ({r.examples} examples): "
                    f"{r.message}",
                    flush=True,
                )
            else:
                print(
                    f"  not caught by {r.suite:<9} in {r.seconds:5.2f} s "
                    f"({r.examples} examples)",
                    flush=True,
                )
        if not results[-1].caught:
            missed.append(name)
    print(log.summary(), flush=True)
    caught_by = ", ".join(f"{suite} {n}" for suite, n in by.most_common())
    took = f"in {time.monotonic() - t0:.0f} s"
    if missed:
        print(
            f"fuzz --self-test: NOT caught: {', '.join(missed)} ({took}; caught by: "
            f"{caught_by or 'none'})",
            flush=True,
        )
        return 1
    print(
        f"fuzz --self-test: all {len(bugs)} planted bugs caught {took} (caught by: "
        f"{caught_by})",
        flush=True,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
