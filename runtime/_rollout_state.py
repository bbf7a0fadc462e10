"""The rollouts' decisions kept across restarts (``runtime.rollout_state_file``,
docs/rollout.md).

One JSON file holds, per model, the state of its rollout (promoted, rolled back,
or a canary on trial, paused or not, at a step with the time served in it) and
what it was decided for: the stable and the canary, a fingerprint of each one's
backend and options, and the steps; for a trial the operator started while
serving, also its rules and the configuration's rollout it replaced. It is
read once when the runtime opens (a file that cannot be read or is not such a
document is a ConfigError naming it: a decision misread could canary again a
version rolled back for its errors; so is a path where no file can be written,
as a directory that is not there: each decision would be lost), and written
whole after each decision, atomically (a temporary file in the same directory,
flushed to the disk, then ``os.replace``) by a task of its own in a worker
thread: a decision is recorded at once in memory and written moments later,
never holding up a request. A write that fails is logged and counted, and the
next decision writes the whole file again. The close waits for the disk within
bounds (``FINAL_WRITE_S``): a write it gives up on never lands later.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import trio

from ._config import Config, ModelConfig
from ._errors import ConfigError

log = logging.getLogger("trioserve")

#: The document's ``format``: a later one is refused, not misread.
FORMAT = 1
#: The largest state file read: a few hundred bytes a model.
MAX_STATE_BYTES = 16 * 1024**2
#: The states recorded (a canary on trial with its progress, paused or not, too).
RECORDED = ("promoted", "rolled_back", "paused", "canary")
#: The rules of a trial the operator started, recorded beside its ``steps``.
RULE_KEYS = ("step_s", "min_requests", "max_error_rate", "max_latency_ratio")
#: How long the close waits for a write under way when the runtime is cancelled,
#: and then for the write of the decisions not yet written.
FINAL_WRITE_S = 5.0
#: The longest the close waits on a write's thread at a time before it looks at the
#: event loop's clock again (see ``_wait_written``).
_SLICE_S = 0.1

_REMEDY = "fix it, or remove it to start every rollout afresh"

#: The state files (real paths) that a runtime of this process writes now.
_WRITING: set[str] = set()


def version_fingerprint(m: ModelConfig, version: str) -> str:
    """What ``version`` of ``m`` is served with, as a short digest: its backend (a
    built-in's name or an import string as written; for a Python object, its type's
    or function's qualified name) and its options (merged over the model's). The
    same configuration gives the same digest in every run of the server."""
    backend, options = m.backend, dict(m.options)
    tables = m.versions.tables
    if tables is not None and version in tables:
        t = tables[version]
        if t.backend is not None:
            backend = t.backend
        options.update(t.options or {})
    if not isinstance(backend, str):
        named = backend if callable(backend) and hasattr(backend, "__qualname__") else type(backend)
        backend = f"{getattr(named, '__module__', '?')}:{named.__qualname__}"
    text = json.dumps(
        {"backend": backend, "options": options}, sort_keys=True,
        default=lambda o: f"<{type(o).__qualname__}>",
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Ownership:
    """Whether a write of a state file may still land: once ``revoke``-d (the write
    abandoned at the close, past ``FINAL_WRITE_S``), the write still under way in
    its thread replaces nothing, so that it cannot overwrite newer decisions, nor
    what a later runtime wrote. The check and the rename are made under one lock,
    held across the rename alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owned = True
        self.begun = False

    def replace(self, tmp: str, path: str) -> bool:
        """``os.replace(tmp, path)`` if still owned; whether it was. Blocking."""
        with self._lock:
            if not self._owned:
                return False
            os.replace(tmp, path)
            return True

    def begin(self) -> bool:
        """Mark the write begun if still owned; whether it was (a write revoked
        before it began creates no temporary file). Under the lock, so that a
        revocation comes wholly before it (it writes nothing, ``begun`` stays False)
        or after it (``begun`` is True by then: it renames nothing). Blocking,
        briefly."""
        with self._lock:
            if self._owned:
                self.begun = True
            return self._owned

    def revoke_nowait(self) -> bool:
        """Revoke it, unless a rename is under way this moment (then False: call
        :meth:`revoke` in a worker thread). Not a checkpoint; never blocks."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._owned = False
        finally:
            self._lock.release()
        return True

    def revoke(self) -> None:
        """Revoke it once the rename under way (if any) is done. Blocking."""
        with self._lock:
            self._owned = False


def write_atomic(path: str, data: bytes, *, owner: Ownership | None = None) -> None:
    """Replace ``path``'s content with ``data`` at once: a temporary file beside it,
    written and flushed to the disk, renamed over it (then the directory flushed).
    A reader sees the old content or the new, never part of one; on an error the
    temporary file is removed and ``path`` left as it was. A ``path`` that is a
    symbolic link is followed: the file it names is replaced, the link kept. With
    an ``owner`` revoked before the rename, nothing is replaced (the temporary file
    is removed). Blocking: run it in a worker thread."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if owner is None:
            os.replace(tmp, path)
        elif not owner.replace(tmp, path):
            os.unlink(tmp)
            return
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # the rename itself is durable once the directory is (not every system lets a
    # directory be opened: the file is in place either way)
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _unwritable(real: str) -> tuple[str, str] | None:
    """Why no state file can be written at ``real`` (the path, links followed), and
    what to do, or None: a directory there, or a directory beside it in which no
    file can be created (each write creates its temporary file there: one is
    created, and removed). Blocking."""
    setting = "runtime.rollout_state_file"
    if os.path.isdir(real):
        return "is a directory, not a file", f"set {setting} to a file's path"
    folder = os.path.dirname(real)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(real)}.",
                                   suffix=".tmp")
    except FileNotFoundError as exc:
        if not os.path.isdir(folder):
            return (f"its directory {folder} does not exist",
                    f"create it, or set {setting} to a file in a directory that exists")
        unusable: OSError = exc  # (a directory of a system's, such as /proc)
    except NotADirectoryError:
        return (f"its directory {folder} is not a directory",
                f"set {setting} to a file in a directory")
    except OSError as exc:
        unusable = exc
    else:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return (f"no file can be created in its directory {folder}: "
            f"{unusable.strerror or unusable}",
            f"make the directory writable, or set {setting} to a file in one that is")


def _read(path: str) -> bytes | None:
    """The file's bytes, None when there is none. Blocking."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None


def _parse(path: str, raw: bytes) -> dict[str, dict[str, Any]]:
    """The records of a state file's bytes, each checked; ConfigError names the file
    and what is wrong."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path}: rollout state file (runtime.rollout_state_file): "
                           f"{what}; {_REMEDY}")

    if len(raw) > MAX_STATE_BYTES:
        raise bad(f"over {MAX_STATE_BYTES // 1024**2} MiB, not a state file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or "models" not in doc or "format" not in doc:
        raise bad("not a rollout state file (expected a JSON object with "
                  "'format' and 'models')")
    if doc["format"] != FORMAT:
        raise bad(f"format {doc['format']!r}, this server reads format {FORMAT}")
    models = doc["models"]
    if not isinstance(models, dict):
        raise bad("'models' must be an object of model name -> record")
    for name, rec in models.items():
        why = _invalid(rec)
        if why is not None:
            raise bad(f"the record of model {name!r}: {why}")
    return models


def _invalid(rec: Any) -> str | None:
    """Why ``rec`` is not a well-formed record, or None."""
    if not isinstance(rec, dict):
        return "must be an object"
    expected = {"state": str, "stable": str, "canary": str, "versions": dict,
                "steps": list, "step": int}
    for key, kind in expected.items():
        value = rec.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{key!r} must be a JSON {kind.__name__}, got {value!r}"
    if rec["state"] not in RECORDED:
        return f"'state' must be one of {', '.join(RECORDED)}, got {rec['state']!r}"
    if not all(isinstance(v, str) for v in rec["versions"].values()):
        return "'versions' must map each version to its fingerprint (a string)"
    steps = rec["steps"]
    if not steps or not all(isinstance(s, int | float) and not isinstance(s, bool)
                            for s in steps):
        return f"'steps' must be a non-empty list of shares, got {steps!r}"
    if not 0 <= rec["step"] < len(steps):
        return f"'step' {rec['step']} is not one of its {len(steps)} steps"
    reason = rec.get("reason")
    if reason is not None and not isinstance(reason, str):
        return f"'reason' must be a string or null, got {reason!r}"
    elapsed = rec.get("elapsed_s", 0.0)  # (absent from a file of an earlier server)
    if (not isinstance(elapsed, int | float) or isinstance(elapsed, bool)
            or not math.isfinite(elapsed) or elapsed < 0):
        return f"'elapsed_s' must be a number >= 0, got {elapsed!r}"
    started = rec.get("started")
    if started is not None:
        return _invalid_started(rec, started)
    return None


def _invalid_started(rec: dict[str, Any], started: Any) -> str | None:
    """Why the ``started`` part of a record (a trial the operator started) is not
    well-formed, or None. Its rules are checked as the configuration's are."""
    if not isinstance(started, dict):
        return f"'started' must be an object, got {started!r}"
    configured = started.get("configured")
    if (not isinstance(configured, dict) or not isinstance(configured.get("stable"), str)
            or not isinstance(configured.get("canary"), str | None)):
        return ("'started.configured' must be an object of the configuration's 'stable' "
                f"(a string) and 'canary' (a string or null), got {configured!r}")
    if started.get("stable_from") not in ("promoted", "previous", "configuration"):
        return ("'started.stable_from' must be one of promoted, previous, configuration, "
                f"got {started.get('stable_from')!r}")
    rules = started.get("rules")
    if not isinstance(rules, dict) or set(rules) != set(RULE_KEYS):
        return f"'started.rules' must be an object of {', '.join(RULE_KEYS)}, got {rules!r}"
    from ._versions_config import RolloutConfig

    try:
        RolloutConfig(stable=rec["stable"], canary=rec["canary"], steps=rec["steps"], **rules)
    except ConfigError as exc:
        return f"'started': {exc}"
    return None


class RolloutStateFile:
    """The runtime's state file: the records read at start, each decision since,
    and the task (``run``) that writes them."""

    def __init__(
        self, path: str, records: Mapping[str, dict[str, Any]], *, real_path: str | None = None
    ) -> None:
        self.path = path
        #: the file it names, links followed: what tells two runtimes' files apart
        self.real_path = real_path if real_path is not None else path
        self._records = dict(records)
        self._wanted = 0  # changes made
        self._done = 0  # changes written (or whose write failed)
        self._wake = trio.Event()
        self._settled = trio.lowlevel.ParkingLot()  # flush's waiters
        #: the write whose thread has not returned yet, if any
        self._under_way: _Write | None = None
        self.writes = 0
        self.write_errors = 0
        self.last_error: str | None = None

    @classmethod
    async def open(cls, path: str) -> RolloutStateFile:
        """Read ``path`` (in a worker thread): none there is no record at all.
        ConfigError when it could not be written (a directory that is not there or
        not writable, a directory at the path: every decision's write would fail, and
        the decisions be lost at the next start), cannot be read or is not a state
        file."""
        try:
            real = await trio.to_thread.run_sync(os.path.realpath, path)
            unwritable = await trio.to_thread.run_sync(_unwritable, real)
            if unwritable is not None:
                why, remedy = unwritable
                raise ConfigError(
                    f"{path}: rollout state file (runtime.rollout_state_file): cannot be "
                    f"written: {why} (every decision's write would fail, and the "
                    f"decisions be lost at a restart); {remedy}"
                )
            raw = await trio.to_thread.run_sync(_read, path)
        except OSError as exc:
            raise ConfigError(
                f"{path}: rollout state file (runtime.rollout_state_file): cannot be "
                f"read: {exc.strerror or exc}; {_REMEDY}"
            ) from None
        return cls(path, _parse(path, raw) if raw is not None else {}, real_path=real)

    def record_of(self, model: str) -> dict[str, Any] | None:
        """The decision recorded for ``model`` (a copy), or None."""
        rec = self._records.get(model)
        return dict(rec) if rec is not None else None

    def put(self, model: str, record: dict[str, Any] | None) -> None:
        """Record ``model``'s decision (None: it has none in force any more) and wake
        the writer. Not a checkpoint."""
        if record is None:
            self._records.pop(model, None)
        else:
            self._records[model] = record
        self._wanted += 1
        self._wake.set()

    def statistics(self) -> dict[str, Any]:
        """The file's path, its writes done and failed, the last failure's text."""
        return {"path": self.path, "writes": self.writes, "write_errors": self.write_errors,
                "last_error": self.last_error}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Write the file after each change, until cancelled (several changes made
        meanwhile: one write). Cancelled, it waits, shielded, for a write under way
        (its thread may not return: a disk that hangs) for up to ``FINAL_WRITE_S``,
        then writes the changes not written yet, for up to ``FINAL_WRITE_S`` too. A
        write abandoned at either bound replaces nothing, even when its thread ends
        later: once this returns, no write of it can land (a later runtime may be
        writing the file), and an abandoned write never lands over a later one.

        ConfigError, before it starts, when another runtime of this process writes
        the same file: each writes the whole file from its own records, so one's
        writes would drop the other's decisions."""
        key = self.real_path
        if key in _WRITING:
            raise ConfigError(
                f"{self.path}: rollout state file (runtime.rollout_state_file): already "
                "used by another runtime of this process (each writes the whole file: "
                "one would drop the other's decisions); give each runtime its own file"
            )
        _WRITING.add(key)
        try:
            task_status.started()
            while True:
                if self._done == self._wanted:
                    self._wake = trio.Event()
                    await self._wake.wait()
                job = self._under_way = self._job()
                # cancelled (the close), the thread goes on: _close waits for it
                await trio.to_thread.run_sync(job.run, abandon_on_cancel=True)
                self._under_way = None
                self._settle(job)
        finally:
            try:
                with trio.CancelScope(shield=True):
                    await self._close()
            finally:
                _WRITING.discard(key)

    async def _close(self) -> None:
        """The end of ``run`` (shielded): the write under way, if any, then the
        changes not written yet, each within ``FINAL_WRITE_S``."""
        job, self._under_way = self._under_way, None
        revoked = job is not None and not job.begun and job.owner.revoke_nowait()
        if revoked and job.begun:  # type: ignore[union-attr]
            # it began as it was revoked: it renames nothing, and removes its
            # temporary file; waited for, so that none is left once this returns
            await _wait_written(job, FINAL_WRITE_S)  # type: ignore[arg-type]
        elif revoked:
            # cancelled before its thread began (it may yet, and then writes
            # nothing): its changes are the final write's
            pass
        elif job is not None:
            if await _wait_written(job, FINAL_WRITE_S):
                self._settle(job)
            else:
                log.error("rollout state file %s: a write under way when the runtime "
                          "closed did not end within %g s (it is abandoned: it will not "
                          "replace the file)", self.path, FINAL_WRITE_S)
                await self._abandon(job)
        if self._done == self._wanted:
            return
        job = self._job()
        job.start()
        if await _wait_written(job, FINAL_WRITE_S):
            self._settle(job)
            return
        log.error("rollout state file %s: the last decisions were not written within "
                  "%g s of the close (that write is abandoned: it will not replace the "
                  "file)", self.path, FINAL_WRITE_S)
        await self._abandon(job)

    async def _abandon(self, job: _Write) -> None:
        """Revoke ``job``'s rename (its thread then renames nothing): at once, or,
        with the rename under way this very moment, once it is done, within
        ``FINAL_WRITE_S``."""
        if job.owner.revoke_nowait():
            return
        with trio.move_on_after(FINAL_WRITE_S) as late:
            await trio.to_thread.run_sync(job.owner.revoke, abandon_on_cancel=True)
        if late.cancelled_caught:
            log.error("rollout state file %s: a rename of it begun before the close did "
                      "not end within %g s; it may still land", self.path, FINAL_WRITE_S)

    async def flush(self) -> None:
        """Wait until every change made so far was written (or failed to be). A
        checkpoint; cancelling it only stops the wait."""
        await trio.lowlevel.checkpoint()
        while self._done != self._wanted:
            await self._settled.park()

    def _job(self) -> _Write:
        """A write of every change made so far (not started)."""
        data = json.dumps({"format": FORMAT, "models": self._records}, indent=1,
                          sort_keys=True).encode()
        return _Write(functools.partial(write_atomic, self.path, data), self._wanted)

    def _settle(self, job: _Write) -> None:
        """Count a write whose thread returned, and wake ``flush``'s waiters. Raises
        what the write raised when it is not an OSError (a bug, not the disk)."""
        exc = job.error
        if exc is not None and not isinstance(exc, OSError):
            raise exc
        if exc is not None:
            self.write_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("rollout state file %s: cannot write the rollouts' decisions "
                      "(%s); serving goes on, the next decision tries again",
                      self.path, self.last_error)
        else:
            self.writes += 1
        self._done = job.wanted
        self._settled.unpark_all()


class _Write:
    """One write of the file, in a worker thread, of the changes up to ``wanted``;
    ``begun`` once its thread has begun it, ``done`` once its thread returns, with
    ``error`` what it raised. Its ``owner`` revoked, it replaces nothing."""

    def __init__(self, write: Any, wanted: int) -> None:
        self._write = write
        self.wanted = wanted
        self.owner = Ownership()
        self.done = threading.Event()
        self.error: Exception | None = None

    @property
    def begun(self) -> bool:
        """Whether its thread has begun it (:meth:`Ownership.begin`)."""
        return self.owner.begun

    def run(self) -> None:
        """The write itself. Blocking: in a worker thread."""
        try:
            if not self.owner.begin():
                return  # revoked before it began: nothing to write, nor to remove
            self._write(owner=self.owner)
        except Exception as exc:  # raised (or counted) by the task: _settle
            self.error = exc
        finally:
            self.done.set()

    def start(self) -> None:
        """Run it in a thread of its own, waited for with :func:`_wait_written`
        (trio's worker threads cannot be waited for with a bound but by abandoning
        the wait). A daemon: a disk that never answers holds no exit."""
        threading.Thread(target=self.run, name="trioserve-rollout-write", daemon=True).start()


async def _wait_written(job: _Write, bound: float) -> bool:
    """Wait until ``job``'s thread has returned (True), or ``bound`` seconds of the
    event loop's clock have passed (False). A checkpoint.

    A trio timer alone would not do: on a clock that jumps to the next deadline
    whenever every task waits (trio's autojumping MockClock), it would end the wait
    as soon as it begins, whatever the thread's progress. So the wait is made in
    slices: a worker thread waits for the write for at most ``_SLICE_S`` of real
    time, then, if the loop's clock has moved less than that meanwhile, the rest of
    the slice passes on the loop's clock. On the system clock the bound is the
    real time waited; on a clock that jumps, the thread gets as much real time; on a
    clock moved by hand, the wait ends within a slice of the bound passing."""
    deadline = trio.current_time() + bound
    while not job.done.is_set():
        now = trio.current_time()
        if now >= deadline:
            return False
        until = min(now + _SLICE_S, deadline)
        await trio.to_thread.run_sync(job.done.wait, until - now, abandon_on_cancel=True)
        if not job.done.is_set() and trio.current_time() < until:
            await trio.sleep_until(until)
    await trio.lowlevel.checkpoint()
    return True


async def open_state_file(config: Config) -> RolloutStateFile | None:
    """The runtime's state file, read, when ``runtime.rollout_state_file`` is set
    and some model has a rollout (else None). Records of models that have no
    rollout in this configuration are kept, unused, and logged."""
    path = config.runtime.rollout_state_file
    if path is None or not any(m.rollout is not None for m in config.models):
        return None
    store = await RolloutStateFile.open(path)
    rolled = {m.name for m in config.models if m.rollout is not None}
    for name in sorted(set(store._records) - rolled):
        log.info("rollout state file %s: the decision recorded for model %r is not "
                 "used: the configuration gives it no rollout", path, name)
    return store


class Keeper:
    """One model's rollout as its state file keeps it: what its decisions are
    recorded for (the stable, the canary, their fingerprints, the steps), the
    record it may start from (``recorded``), and each change since (``decided``)."""

    def __init__(self, store: RolloutStateFile, m: ModelConfig) -> None:
        r = m.rollout
        assert r is not None
        self.store = store
        self.model = m.name
        self._m = m
        self._configured = {"stable": r.stable, "canary": r.canary}
        self._shadow = r.shadow
        self._for: dict[str, Any] = {
            "stable": r.stable,
            "canary": r.canary,
            "versions": {v: version_fingerprint(m, v) for v in (r.stable, r.canary)
                         if v is not None},
            "steps": list(r.steps),
        }

    def recorded(self) -> tuple[dict[str, Any] | None, str | None]:
        """The record of this model that this configuration starts from, or (None,
        why not): None, None when nothing is recorded."""
        rec = self.store.record_of(self.model)
        if rec is None:
            return None, None
        if rec.get("started") is not None:
            return self._started_record(rec)
        now = self._for
        if now["canary"] is None:
            return None, "the configuration has no canary now"
        if (rec["stable"], rec["canary"]) != (now["stable"], now["canary"]):
            return None, (
                f"it was decided for stable {rec['stable']!r} and canary {rec['canary']!r}, "
                f"the configuration has stable {now['stable']!r} and canary {now['canary']!r}"
            )
        for v in (now["stable"], now["canary"]):
            if rec["versions"].get(v) != now["versions"][v]:
                return None, f"the backend or options of version {v!r} changed since"
        if rec["state"] in ("paused", "canary") and rec["steps"] != now["steps"]:
            return None, (
                f"its canary was on trial at step {rec['step'] + 1} of steps "
                f"{rec['steps']}, the configuration's steps are now {now['steps']}"
            )
        if rec["step"] >= len(now["steps"]):
            # a promotion or rollback made at a step the configuration no longer has
            # (a trial's steps are the same): its decision holds whatever the steps,
            # shown at the last one there is
            rec["step"] = len(now["steps"]) - 1
        return rec, None

    def _started_record(self, rec: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """A trial the operator started: used while the configuration's rollout is
        the one it replaced (the same stable and canary) and its versions are still
        the model's, served as they were, neither of them the shadow."""
        was = rec["started"]["configured"]
        if (was["stable"], was["canary"]) != (self._configured["stable"],
                                              self._configured["canary"]):
            return None, (
                f"it was started by the operator in place of the configuration's stable "
                f"{was['stable']!r} and canary {was['canary']!r}, the configuration now has "
                f"stable {self._configured['stable']!r} and canary "
                f"{self._configured['canary']!r}"
            )
        for v in (rec["stable"], rec["canary"]):
            if v not in self._m.versions:
                return None, f"its version {v!r} is no longer one of the model's"
            if rec["versions"].get(v) != version_fingerprint(self._m, v):
                return None, f"the backend or options of version {v!r} changed since"
            if v == self._shadow:
                return None, f"its version {v!r} is the configuration's shadow now"
        return rec, None

    def decided(self, rollout: Any, now: float) -> None:
        """``rollout`` (a ``Rollout``) changed at ``now``: record its state, and a
        canary on trial's step and time served in it. Not a checkpoint."""
        state = rollout.state.value
        if state not in RECORDED:
            self.store.put(self.model, None)
            return
        if rollout.origin == "operator":
            rules = rollout.rules
            made_for: dict[str, Any] = {
                "stable": rollout.stable,
                "canary": rollout.canary,
                "versions": {v: version_fingerprint(self._m, v)
                             for v in (rollout.stable, rollout.canary)},
                "steps": list(rules.steps),
                "started": {
                    "configured": dict(self._configured),
                    "stable_from": rollout.stable_from,
                    "rules": {k: getattr(rules, k) for k in RULE_KEYS},
                },
            }
        else:
            made_for = self._for
        record = {**made_for, "state": state, "step": rollout.step, "reason": rollout.reason}
        elapsed = rollout.step_elapsed(now)
        if elapsed is not None:
            record["elapsed_s"] = elapsed
        if record != self.store.record_of(self.model):  # (else nothing to write)
            self.store.put(self.model, record)

    def statistics(self) -> dict[str, Any]:
        return self.store.statistics()
