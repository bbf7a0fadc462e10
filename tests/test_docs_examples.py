"""The examples of README.md, docs/*.md and fuzz/README.md run as written.

Each page is parsed as Markdown (fenced blocks and indented blocks), so a new example
is picked up without touching this file:

- a ```python block is executed in process (the built-in configuration; an async
  example runs under ``trio.run`` as it says);
- a ```toml block is read with ``trioserve.load_config``; configuration.md's full
  example must also show every key of every table, with the default its comments
  state;
- a shell block (```sh, or an indented block) holds command lines: ``curl`` lines are
  sent to a real server on a free loopback port, ``trioserve``, ``make`` and ``python
  -m fuzz`` lines must parse as those programs parse them;
- a ```text block is output or a drawing, not an example.

A block that is deliberately not runnable (a sketch, a command of another project)
has ``<!-- not run: why -->`` right before it; there are few.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trioserve
from markdown_it import MarkdownIt
from trioserve._config import DEFAULT_SLO_TARGET, default_classes

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "fuzz" / "README.md"]
LANGUAGES = {"python", "toml", "sh", "text"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->", re.DOTALL)
#: Deliberately unrunnable blocks are the exception: a new one needs a good reason.
MAX_NOT_RUN = 4


@attrs.frozen
class Block:
    page: str
    line: int
    lang: str
    text: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    md = MarkdownIt("commonmark")
    out = []
    for page in PAGES:
        tokens = md.parse(page.read_text())
        for i, tok in enumerate(tokens):
            if tok.type not in ("fence", "code_block"):
                continue
            before = tokens[i - 1] if i else None
            why = None
            if before is not None and before.type == "html_block":
                found = NOT_RUN.search(before.content)
                why = found[1] if found else None
            # an indented block is a terminal's: command lines
            lang = tok.info.split()[0] if tok.type == "fence" and tok.info.strip() else ""
            lang = lang if tok.type == "fence" else "sh"
            name = str(page.relative_to(ROOT))
            out.append(Block(name, tok.map[0] + 1, lang, tok.content, why))
    return out


BLOCKS = _blocks()


def _run(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang and b.not_run is None]


def _commands(block: Block) -> Iterator[tuple[str, list[str]]]:
    """Each command line of a shell block (backslash continuations joined), as its
    text and as the shell splits it; lines of comment alone are none."""
    text = block.text.replace("\\\n", " ")
    for line in text.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            yield line, argv


def test_every_block_says_what_it_is():
    """Each fenced block names its language (python, toml, sh, or text for output and
    drawings), so that none is left unchecked by mistake; the blocks marked not run
    are few and each says why."""
    for b in BLOCKS:
        assert b.lang in LANGUAGES, (b.id, b.lang or "a fence without a language")
    marked = [b for b in BLOCKS if b.not_run is not None]
    assert len(marked) <= MAX_NOT_RUN, [b.id for b in marked]
    assert len(_run("python")) >= 4
    assert len(_run("toml")) >= 2
    assert sum(1 for b in _run("sh") for _ in _commands(b)) >= 15


def test_a_not_run_marker_stands_right_before_its_block():
    """A marker that is not right before a block (a blank line is fine; prose is not)
    would silently mark nothing."""
    markers = sum(len(NOT_RUN.findall(p.read_text())) for p in PAGES)
    assert markers == sum(b.not_run is not None for b in BLOCKS)


# ---------------------------------------------------------------- python
#: The namespace each python block left, so that a test of what it gives reruns none.
_RAN: dict[str, dict[str, Any]] = {}


def _exec(block: Block) -> dict[str, Any]:
    """Run ``block`` as a script is run (a fresh namespace, from the repository root,
    where the README's commands are typed), once."""
    if block.id not in _RAN:
        code = compile(block.text, block.id, "exec")
        namespace: dict[str, Any] = {"__name__": "__main__"}
        cwd = Path.cwd()
        os.chdir(ROOT)
        try:
            exec(code, namespace)
        finally:
            os.chdir(cwd)
        _RAN[block.id] = namespace
    return _RAN[block.id]


@pytest.mark.parametrize("block", _run("python"), ids=lambda b: b.id)
def test_python_example_runs(block):
    _exec(block)


def _python(page: str, first_line: str) -> Block:
    for b in _run("python"):
        if b.page == page and b.text.startswith(first_line):
            return b
    raise AssertionError(f"no python block of {page} starts with {first_line!r}")


def test_the_readme_example_gives_what_its_comments_say():
    """``out`` is ``{"y": array of 16 floats}``."""
    out = _exec(_python("README.md", "import numpy as np, trio, trioserve"))["out"]
    assert set(out) == {"y"}
    assert out["y"].shape == (16,)
    assert out["y"].dtype == np.float32


def test_the_embedding_examples_give_what_their_comments_say():
    """docs/embedding.md: the mlp's ``y`` has shape (16,), echo returns ``{"a":
    array([1, 2, 3])}``, ``infer_batch`` answers its items in order, and the blocking
    client's ``infer_many`` keeps input order."""

    async def main():
        async with trioserve.open_runtime(trioserve.load_config()) as rt:
            out = await rt.infer("mlp", np.zeros(256, np.float32))
            assert out["y"].shape == (16,)
            echoed = await rt.infer("echo", {"a": [1, 2, 3]})
            assert list(echoed) == ["a"]
            assert echoed["a"].tolist() == [1, 2, 3]
            xs = [np.full(256, i, np.float32) for i in range(8)]
            outs = await rt.infer_batch("mlp", xs)
            for x, o in zip(xs, outs, strict=True):
                expected = await rt.infer("mlp", x)
                # the same item, alone or in a batch of 8: equal up to float rounding
                np.testing.assert_allclose(o["y"], expected["y"], rtol=1e-4, atol=1e-5)
            with pytest.raises(TypeError):
                await rt.infer("mlp", xs[0], timeout=1.0)  # "No timeout= on async calls"

    trio.run(main)


def test_your_own_model_serves_from_python_and_from_its_toml(tmp_path, monkeypatch):
    """docs/embedding.md's "Your own models": the Python block's config serves
    ``double``, and so does its TOML block with the Python block saved as
    ``mymodels.py`` on the path."""
    source = _python("docs/embedding.md", "import trioserve\nfrom trioserve import TensorSpec").text
    toml = next(b.text for b in _run("toml") if "mymodels:" in b.text)
    (tmp_path / "mymodels.py").write_text(source)
    (tmp_path / "double.toml").write_text(toml)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(source, namespace)

    async def serve(config: trioserve.Config) -> np.ndarray:
        async with trioserve.open_runtime(config) as rt:
            return (await rt.infer("double", np.arange(3, dtype=np.float32)))["y"]

    for config in (namespace["config"], trioserve.load_config(tmp_path / "double.toml")):
        assert trio.run(serve, config).tolist() == [0.0, 2.0, 4.0]


# ---------------------------------------------------------------- toml
@pytest.mark.parametrize("block", _run("toml"), ids=lambda b: b.id)
def test_toml_example_loads(block, tmp_path):
    path = tmp_path / "example.toml"
    path.write_text(block.text)
    config = trioserve.load_config(path)
    assert config.models


def _full_example() -> Block:
    """configuration.md's full example: its first TOML block (later ones show one
    table on its own)."""
    return next(b for b in _run("toml") if b.page == "docs/configuration.md")


_TABLES = {
    "runtime": trioserve.RuntimeLimits, "server": trioserve.ServerConfig,
    "cache": trioserve.CacheConfig, "models": trioserve.ModelConfig,
    "tenants": trioserve.TenantConfig, "classes": trioserve.ClassConfig,
}
#: A stated default that is not a TOML value, and the value that stands for it.
_PHRASES = {
    "one per device": None, "the backend's choice": None, "unlimited": None,
    "one second of rate": None, "all": (), "the model's": None, "until evicted": None,
}
#: Keys whose shown value is an example (a [models.*] table must name its backend;
#: the options are the mlp's own), not the default.
_EXAMPLES = {("models", "backend"), ("models", "options")}


@attrs.define
class _Key:
    table: str
    name: str
    shown: Any
    commented: bool
    comment: str


def _keys(text: str) -> list[_Key]:
    """Each ``key = value`` line of the example (commented out or not), with its
    comment and the comment lines that continue it."""
    keys: list[_Key] = []
    table = ""
    for line in text.splitlines():
        if head := re.fullmatch(r"\[(\w+)(?:\.[^\]]+)?\]\s*(#.*)?", line):
            table = head[1]
            keys.append(_Key(table, "", None, False, head[2] or ""))
            continue
        entry = re.fullmatch(r"(# )?(\w+) = (.*?)(?:\s+# ?(.*))?", line)
        if entry and table:
            shown = tomllib.loads(f"v = {entry[3]}")["v"]
            keys.append(_Key(table, entry[2], shown, bool(entry[1]), entry[4] or ""))
        elif (more := re.fullmatch(r"\s+# (.*)", line)) and keys:
            keys[-1].comment += " " + more[1]
    return [k for k in keys if k.name]


def _default(cls: type, name: str) -> Any:
    default = attrs.fields_dict(cls)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default


def _comparable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def test_the_full_configuration_example_shows_every_key():
    """configuration.md's example is the reference: each table's every key is in it."""
    shown = {(k.table, k.name) for k in _keys(_full_example().text)}
    for table, cls in _TABLES.items():
        for field in attrs.fields(cls):
            if field.name != "name":
                assert (table, field.name) in shown, (table, field.name)


def test_the_full_configuration_examples_defaults_are_the_codes():
    """Each key of configuration.md's example states its default: the value shown
    (for [runtime], [server], [cache] and [models.*]), none for a key commented out,
    or a ``default: X`` / ``(default X)`` in its comment; each is the code's."""
    checked = 0
    for key in _keys(_full_example().text):
        cls = _TABLES[key.table]
        actual = _comparable(_default(cls, key.name))
        stated = re.search(r"\bdefault:? ([^);]+)", key.comment)
        where = (key.table, key.name, key.comment)
        if stated and "the default" not in key.comment:
            phrase = stated[1].strip()
            if phrase in _PHRASES:
                expected = _PHRASES[phrase]
            else:
                expected = tomllib.loads(f"v = {phrase}")["v"]
        elif key.commented:
            expected = None  # optional: absent unless set
        elif key.table in ("tenants", "classes") or (key.table, key.name) in _EXAMPLES:
            continue  # the example's own values
        else:
            expected = key.shown
        assert actual == _comparable(expected), where
        checked += 1
    assert checked > 50
    (slo_target,) = [k for k in _keys(_full_example().text) if k.name == "slo_target"]
    # "(above 0, below 1; 0.99 if not set"
    assert re.search(r"([\d.]+) if not set", slo_target.comment)[1] == str(DEFAULT_SLO_TARGET)


def test_the_example_classes_are_the_default_classes():
    """"Request classes, highest priority first (default: these two)"."""
    assert "(default: these two)" in _full_example().text
    config = trioserve.config_from_mapping(tomllib.loads(_full_example().text))
    assert config.classes == default_classes()


def _mapping(table: str, key: str, value: Any) -> dict[str, Any]:
    model = {"backend": "echo"}
    data: dict[str, Any] = {"models": {"m": model}}
    if table == "models":
        model[key] = value
    elif table == "tenants":
        data[table] = {"t": {key: value}}
    else:
        data[table] = {key: value}
    return data


def test_the_ranges_the_example_states_are_the_codes():
    """A key whose comment says ``A to B`` or ``at most B`` takes A and B, and is a
    ConfigError naming it one past either end."""
    checked = 0
    for key in _keys(_full_example().text):
        if key.name == "options":
            continue  # the backends' options, each its own range
        first = key.comment.split(";")[0] if key.name != "switch_interval_us" else key.comment
        span = re.search(r"\b(\d+) to (\d+)\b", first)
        most = re.search(r"\bat most (?:[\d.]+ GiB \()?(\d+)\b", first)
        if not (span or most):
            continue
        low, high = (int(span[1]), int(span[2])) if span else (None, int(most[1]))
        for value in (low, high):
            if value is not None:
                trioserve.config_from_mapping(_mapping(key.table, key.name, value))
        outside = [high + 1] + ([low - 1] if low is not None else [])
        for value in outside:
            with pytest.raises(
                trioserve.ConfigError, match=rf"^{key.table}\.([mt]\.)?{key.name}: "
            ):
                trioserve.config_from_mapping(_mapping(key.table, key.name, value))
        checked += 1
    assert checked >= 5


def test_the_error_messages_configuration_md_quotes():
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    quoted = "models.mlp.max_batch_size: must be an integer >= 1, got 0"
    assert quoted in text
    with pytest.raises(trioserve.ConfigError) as bad:
        trioserve.config_from_mapping({"models": {"mlp": {"backend": "mlp", "max_batch_size": 0}}})
    assert str(bad.value) == quoted
    assert "(`did you mean 'max_batch_size'?`)" in text
    with pytest.raises(trioserve.ConfigError, match="did you mean 'max_batch_size'\\?"):
        trioserve.config_from_mapping({"models": {"mlp": {"backend": "mlp", "max_batch_siz": 1}}})


# ---------------------------------------------------------------- command lines
def _parses(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | None:
    """``argv`` parsed; None for an option that prints and exits 0 (--version)."""
    err = io.StringIO()
    code = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as done:
        code = done.code
    assert code == 0, (argv, err.getvalue())
    return None


def _check_trioserve(argv: list[str]) -> None:
    from trioserve.cli import _misplaced, _parser

    parser = _parser()
    args = _parses(parser, argv)
    if args is not None and args.command == "bench":
        assert _misplaced(parser, args) is None, argv


def _make_targets() -> set[str]:
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return set(phony[1].split())


def _shell_commands() -> list[tuple[str, str, list[str]]]:
    return [(b.id, line, argv) for b in _run("sh") for line, argv in _commands(b)]


@pytest.mark.parametrize(
    ("where", "line", "argv"),
    [c for c in _shell_commands() if c[2][0] != "curl"],
    ids=lambda v: v if isinstance(v, str) and ":" in v else "",
)
def test_command_line_parses(where, line, argv):
    """A ``trioserve`` line (any path to it) parses as the CLI parses it, bench's
    combinations included; ``make T ARGS=...`` names a target of the Makefile and its
    ARGS parse for ``serve`` and ``bench``; ``python -m trioserve`` is the first;
    ``python -m fuzz`` lines parse as fuzz's."""
    program = Path(argv[0]).name
    if program == "trioserve":
        _check_trioserve(argv[1:])
    elif program.startswith("python") and argv[1:3] == ["-m", "trioserve"]:
        _check_trioserve(argv[3:])  # the same command, as a module
    elif program == "make":
        target, *rest = argv[1:]
        assert target in _make_targets(), line
        args = [a.removeprefix("ARGS=") for a in rest if a.startswith("ARGS=")]
        if target in ("serve", "bench"):
            _check_trioserve([target, *(a for arg in args for a in shlex.split(arg))])
    elif program.startswith("python") and argv[1:3] == ["-m", "fuzz"]:
        from fuzz._cli import _parser as fuzz_parser

        assert _parses(fuzz_parser(), argv[3:]) is not None, line
    else:
        raise AssertionError(f"{where}: a command this test cannot check: {line!r}; "
                             "mark its block <!-- not run: why --> if it is not ours")


def test_python_lines_name_the_projects_interpreter():
    """A command line that runs Python names ``.venv/bin/python``, the interpreter
    ``make setup`` fills: on a fresh machine a bare ``python`` (or ``python3``) has
    neither trioserve nor its dependencies (docs/fuzzing.md's ``python -m fuzz``
    lines failed so, "No module named 'trioserve'")."""
    lines = [(where, line, argv) for where, line, argv in _shell_commands()
             if Path(argv[0]).name.startswith("python")]
    assert len(lines) >= 5
    for where, line, argv in lines:
        assert argv[0] == ".venv/bin/python", (where, line)


def test_the_readme_names_the_extras_make_installs():
    """README.md says which extras the two commands install: those of the Makefile's
    ``pip install -e '.[...]'`` (it said test and minilm after ray joined them)."""
    extras = re.search(r"pip install -q -e '\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text())
    assert extras is not None
    named = " ".join((ROOT / "README.md").read_text().split())
    listed = ", ".join(f"`{e}`" for e in extras[1].split(",")[:-1])
    assert f"with its {listed} and `{extras[1].split(',')[-1]}` extras" in named


# ---------------------------------------------------------------- curl
def _curl_argv(command: str, path: str) -> list[str]:
    """The arguments a shell passes to curl for ``command`` (quotes, ``$(...)`` and
    continuations as bash expands them, ``python3`` being this interpreter)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{path}"}
    script = "curl() { printf '%s\\0' \"$@\"; }\n" + command
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def _curl_request(argv: list[str]) -> tuple[str, str, list[tuple[str, str]], bytes | None]:
    """(method, URL, headers, body) of the curl options the docs use."""
    url, headers, body, method = None, [], None, None
    args = iter(argv)
    for a in args:
        if a in ("-s", "--silent"):
            continue
        if a in ("-H", "--header"):
            name, _, value = next(args).partition(":")
            headers.append((name.strip(), value.strip()))
        elif a in ("-d", "--data"):
            body = next(args).encode()
        elif a in ("-X", "--request"):
            method = next(args)
        elif a.startswith("-"):
            raise AssertionError(f"a curl option this test does not know: {a}")
        else:
            url = a
    assert url is not None, argv
    return method or ("POST" if body is not None else "GET"), url, headers, body


def _local(url: str, gateway_url: str) -> str:
    """``url`` (``localhost:8000/...``, scheme optional) pointed at the test server."""
    rest = re.sub(r"^(https?://)?(localhost|127\.0\.0\.1):8000", "", url)
    assert rest != url, url
    assert rest.startswith("/"), url
    return gateway_url + rest


@pytest.mark.parametrize("client", ["trioserve", "curl"])
async def test_curl_lines_are_answered_by_the_server_make_serve_runs(client):
    """Each ``curl`` line, expanded as the shell expands it, is sent to the built-in
    configuration served on a free loopback port (what ``make serve`` runs) and
    answered 200 with the model's outputs: by the project's HTTP client, and by the
    line's own curl where curl is installed."""
    from trioserve.transport import open_gateway
    from trioserve.transport._client import HttpClient

    if client == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    texts = {b.id: b.text for b in _run("sh")}
    curls = list(dict.fromkeys(where for where, _, argv in _shell_commands() if argv[0] == "curl"))
    assert curls
    config = trioserve.load_config()
    async with (
        trioserve.open_runtime(config) as rt,
        open_gateway(rt, host="127.0.0.1", port=0) as gw,
    ):
        for where in curls:
            argv = await trio.to_thread.run_sync(_curl_argv, texts[where], os.environ["PATH"])
            if client == "curl":
                local = [_local(a, gw.url) if a.startswith(("localhost", "127.", "http")) else a
                         for a in argv]
                done = await trio.run_process(
                    ["curl", *local, "-w", "\n%{http_code}"], capture_stdout=True
                )
                body, _, status = done.stdout.decode().rpartition("\n")
                assert status == "200", (where, body[:300])
                assert json.loads(body)["outputs"], where
                continue
            method, url, headers, data = _curl_request(argv)
            target = _local(url, gw.url)[len(gw.url):]
            # the client sends its own Content-Type: application/json with a body
            headers = [(n, v) for n, v in headers if n.lower() != "content-type"]
            http = HttpClient(gw.url)
            try:
                answer = await http.request(method, target, data or b"", headers)
            finally:
                await http.aclose()
            assert answer.status == 200, (where, answer.body[:300])
            assert answer.json()["outputs"], where


# ---------------------------------------------------------------- claims the pages make
def test_the_error_table_gives_each_errors_http_status():
    """docs/embedding.md's Errors table: each error derives from TrioserveError and
    is answered over HTTP with the status the table gives (— : never an answer)."""
    text = (ROOT / "docs" / "embedding.md").read_text()
    table = text[text.index("| error | meaning | HTTP |") :].split("\n\n")[0]
    rows = re.findall(r"^\| (`.+?`) \|.*\| ([^|]+) \|$", table, re.MULTILINE)
    assert len(rows) >= 10
    for names, statuses in rows:
        errors = re.findall(r"`(\w+)`", names)
        codes = [s.strip() for s in statuses.split("/")]
        for name, code in zip(errors, codes * len(errors) if len(codes) == 1 else codes,
                              strict=True):
            error = getattr(trioserve, name)
            assert issubclass(error, trioserve.TrioserveError), name
            if code != "—":
                assert error.status == int(code), (name, code)


def _documented_metrics() -> set[str]:
    """The metric names the pages give (``trioserve_cache_{hits,misses}_total``
    expanded, a label set ``{model}`` dropped; ``trioserve_flow_*`` kept as it is)."""
    names = set()
    for page in PAGES:
        for name in re.findall(r"\btrioserve_[\w{},*]+", page.read_text()):
            name = re.sub(r"(?<=[^_])\{.*", "", name)  # labels
            if braces := re.fullmatch(r"(\w*_)\{([\w,]+)\}(\w*)", name):
                names |= {braces[1] + part + braces[3] for part in braces[2].split(",")}
            else:
                names.add(name.rstrip(",").removesuffix("_"))
    return names


async def test_every_metric_the_docs_name_is_on_metrics_and_back(tmp_path):
    """Each ``trioserve_*`` name the pages give is a series of ``/metrics`` (a
    histogram's ``_bucket`` / ``_count`` / ``_sum`` its own), and each series
    ``/metrics`` has is named on some page, with every feature that adds series on."""
    from trioserve.transport import open_gateway
    from trioserve.transport._client import HttpClient

    config = trioserve.Config(
        models=[
            trioserve.ModelConfig(name="echo", backend="echo", slo_ms=50.0),
            trioserve.ModelConfig(
                name="rolled", backend="echo", versions=["1", "2", "3"],
                rollout={"stable": "1", "canary": "2", "shadow": "3"},
            ),
        ],
        tenants=[trioserve.TenantConfig(name="t", default=True, credit_rate=100.0)],
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
        runtime=trioserve.RuntimeLimits(rollout_state_file=str(tmp_path / "rollout.json")),
    )
    async with (
        trioserve.open_runtime(config) as rt,
        open_gateway(rt, host="127.0.0.1", port=0) as gw,
    ):
        await rt.infer("echo", {"x": np.zeros(3, np.float32)})
        http = HttpClient(gw.url)
        try:
            answer = await http.get("/metrics")
        finally:
            await http.aclose()
    assert answer.status == 200
    text = answer.body.decode()
    exposed = set(re.findall(r"^(trioserve_\w+)", text, re.MULTILINE))
    exposed |= set(re.findall(r"^# TYPE (trioserve_\w+)", text, re.MULTILINE))
    documented = _documented_metrics()
    prefixes = tuple(n.removesuffix("*") for n in documented if n.endswith("*"))
    for name in documented:
        if not name.endswith("*"):
            assert name in exposed or re.sub(r"_(bucket|count|sum)$", "", name) in exposed, name
    for series in exposed:
        base = re.sub(r"_(bucket|count|sum)$", "", series)
        assert series in documented or base in documented or series.startswith(prefixes), series
    assert len(documented) > 20
