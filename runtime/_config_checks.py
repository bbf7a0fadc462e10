"""The checks of the configuration's values: each raises ValueError saying what the
value must be; ``_field`` makes an attrs field whose ConfigError names the key
(``models.mlp.max_batch_size``). Used by runtime/_config.py and the tables beside it."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from os import PathLike
from typing import Any

import attrs

from ._errors import ConfigError


def _shown(v: Any) -> str:
    """``repr(v)`` for a message, cut short when long (an integer of hundreds of
    digits, a long string)."""
    try:
        text = repr(v)
    except ValueError:  # an integer past the interpreter's limit on digits printed
        return "an integer of thousands of digits"
    if len(text) <= 60:
        return text
    unit = "digits" if isinstance(v, int) else "characters"
    return f"{text[:40]}... ({len(text.lstrip('-'))} {unit})"


def _finite(v: Any) -> bool:
    """A number (not a bool) that is finite as a float: an integer too large for a
    float (over about 1.8e308) is not."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int(minimum: int, maximum: int | None = None) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {_shown(v)}")
        if maximum is not None and v > maximum:
            raise ValueError(f"must be an integer <= {maximum}, got {_shown(v)}")

    return check


def _port(v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
        raise ValueError(f"must be a port number, 0 to 65535 (0: any free port), got {_shown(v)}")


def _opt_int(minimum: int, maximum: int | None = None) -> Callable[[Any], None]:
    inner = _int(minimum, maximum)

    def check(v: Any) -> None:
        if v is not None:
            inner(v)

    return check


def _number(
    minimum: float, *, strict: bool = False, optional: bool = False, maximum: float | None = None
):
    def check(v: Any) -> None:
        if v is None and optional:
            return
        if not _finite(v) or v < minimum or (strict and v == minimum):
            op = ">" if strict else ">="
            raise ValueError(f"must be a finite number {op} {minimum}, got {_shown(v)}")
        if maximum is not None and v > maximum:
            raise ValueError(f"must be a finite number <= {maximum}, got {_shown(v)}")

    return check


def _open_fraction(v: Any) -> None:
    if v is None:
        return
    if not _finite(v) or not 0.0 < v < 1.0:
        raise ValueError(f"must be a number above 0 and below 1, got {_shown(v)}")


def _choice(options: tuple[str, ...], *, optional: bool = False):
    def check(v: Any) -> None:
        if v is None and optional:
            return
        if v not in options:
            raise ValueError(f"must be one of {', '.join(map(repr, options))}, got {_shown(v)}")

    return check


def _str(v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {_shown(v)}")


def _key(name: Any) -> str:
    """``name`` as a key of a TOML path: bare when it can be, else quoted."""
    if isinstance(name, str) and name and all(c.isalnum() or c in "_-" for c in name):
        return name
    return '"' + repr(name)[1:-1] + '"' if isinstance(name, str) else repr(name)


def _segment(v: Any) -> None:
    """A name that is one segment of a URL path (/v2/models/NAME/versions/V/...):
    non-empty, not ``.`` or ``..``, without ``/`` or control characters."""
    _str(v)
    if v in (".", "..") or "/" in v or any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError(
            f"must be usable as one segment of a URL path (no '/', control characters, "
            f"'.' or '..'), got {_shown(v)}"
        )


def _segments(v: Any) -> None:
    _strs(allow_empty=False)(v)
    for s in v:
        _segment(s)


def _strs(*, allow_empty: bool, secret: bool = False) -> Callable[[Any], None]:
    """A list of non-empty, distinct strings. ``secret`` (API keys): an error names
    no element, which would put a key in the log."""

    def check(v: Any) -> None:
        if not isinstance(v, tuple) or not all(isinstance(s, str) and s for s in v):
            if secret:
                raise ValueError("must be a list of non-empty strings")
            raise ValueError(f"must be a list of non-empty strings, got {_shown(v)}")
        if not v and not allow_empty:
            raise ValueError("must not be empty")
        if len(set(v)) != len(v):
            if secret:
                raise ValueError(f"has duplicates: {len(v)} keys, {len(set(v))} distinct")
            raise ValueError(f"has duplicates: {list(v)!r}")

    return check


def _devices(v: Any) -> None:
    _strs(allow_empty=False)(tuple(dict.fromkeys(v)) if isinstance(v, tuple) else v)
    for d in v:
        head, colon, index = d.partition(":")
        # an index is digits, after a colon that is there only with it ("cuda:" is
        # no device to torch)
        if head not in ("cpu", "cuda") or (colon and not (index.isascii() and index.isdigit())):
            raise ValueError(f"device {d!r} is not 'cpu' or 'cuda:N'")


def _fraction(v: Any) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and 0.0 < v <= 1.0
    if not ok:
        raise ValueError(f"must be a number in (0, 1], got {_shown(v)}")


def _bool(v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {_shown(v)}")


def _mapping(v: Any) -> None:
    if not isinstance(v, Mapping):
        raise ValueError(f"must be a table, got {_shown(v)}")


def _did_you_mean(key: Any, names: list[str] | tuple[str, ...]) -> str:
    """`` did you mean 'max_batch_size'?`` for a key close to one of ``names``."""
    close = difflib.get_close_matches(str(key), names, n=1)
    return f" did you mean {close[0]!r}?" if close else ""


def _tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _checked(check: Callable[[Any], None]):
    """An attrs validator that raises ConfigError naming ``<path>.<field>``."""

    def validator(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        try:
            check(value)
        except ValueError as exc:
            raise ConfigError(f"{inst._path()}.{attribute.name}: {exc}") from None

    return validator


def _field(check: Callable[[Any], None], default: Any = attrs.NOTHING, **kw: Any) -> Any:
    return attrs.field(default=default, validator=_checked(check), **kw)


#: A line as YAML writes a mapping's key (``models:``, ``max_batch_size: 64``) or a
#: document's start (``---``); in TOML a key is followed by ``=``.
_YAML_LINE = re.compile(r"---\s*|[A-Za-z_][\w.-]*:(\s.*)?|- \S.*")


def yaml_hint(path: str | PathLike[str], text: str) -> str:
    """A hint for a file that fails as TOML and is named or written as YAML: the
    config is TOML. Empty for any other file."""
    named = str(path).lower().endswith((".yaml", ".yml"))
    first = next(
        (s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")),
        "",
    )
    if not (named or _YAML_LINE.fullmatch(first)):
        return ""
    return (
        " (the config file is TOML, not YAML: `key = value` lines under `[table]` "
        "headers; docs/configuration.md)"
    )


#: Where tomllib's message says it failed: ``(at line L, column C)``, both from 1.
_TOML_AT = re.compile(r"\(at line (\d+), column (\d+)\)$")
#: A word where TOML wants a value: ``mlp`` in ``backend = mlp`` or ``devices = [cpu]``.
_BARE_WORD = re.compile(r"[A-Za-z_][\w.:/-]*")


def bare_word_hint(message: str, text: str) -> str:
    """A hint for tomllib's ``Invalid value`` (``message``) where a bare word
    stands in ``text``: a string is quoted in TOML, and its booleans are lowercase.
    Empty for any other error."""
    at = _TOML_AT.search(message)
    if at is None or not message.startswith("Invalid value"):
        return ""
    lines = text.split("\n")  # tomllib counts lines by "\n" (a "\r\n" file too)
    line, column = int(at[1]), int(at[2])
    word = _BARE_WORD.match(lines[line - 1], column - 1) if line <= len(lines) else None
    if word is None:
        return ""
    if word[0].lower() in ("true", "false"):
        return f" (TOML's booleans are lowercase: {word[0].lower()}, not {word[0]})"
    return f' (a string is quoted in TOML: "{word[0]}", not {word[0]})'
