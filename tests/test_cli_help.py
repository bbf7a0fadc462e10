"""Every command's --help prints and exits 0 (help texts are %-formatted by argparse),
and the commands the docs show use only options and scenarios there are."""

from __future__ import annotations

import argparse
import errno
import re
import sys
from pathlib import Path

import pytest
import trio
from trioserve.cli import main
from trioserve.scenarios import SCENARIOS


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["bench", "--help"]])
def test_help_prints_and_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if argv[0] == "bench":
        assert "priority: realtime at 70% beside a batch" in " ".join(out.split())
    assert "``" not in out  # plain text, not a docstring's markup


def test_every_option_says_what_it_does():
    """Each option of each command has a help text (``--warmup``, ``--replicas`` and
    four more of ``bench`` had none: a bare ``--warmup WARMUP`` in ``--help``)."""
    from trioserve.cli import _parser

    for command, parser in [("", _parser()), *_subparsers(_parser()).items()]:
        for action in parser._actions:
            if action.option_strings:
                assert action.help, (command, action.option_strings)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_version_prints_and_exits_zero(capsys):
    import trioserve

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"trioserve {trioserve.__version__}\n"


def test_python_dash_m_trioserve_is_the_command():
    """``python -m trioserve`` had no ``__main__``: "No module named trioserve.__main__"."""
    import subprocess

    import trioserve

    done = subprocess.run(
        [sys.executable, "-m", "trioserve", "--version"], capture_output=True, text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, f"trioserve {trioserve.__version__}\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "--port: must be at least 0 and at most 65535, got 70000"),
        (["serve", "--port", "-1"], "--port: must be at least 0 and at most 65535, got -1"),
        (["serve", "--host", ""], "--host: must be an address or host name, got nothing"),
        (["serve", "--config", ""], "--config: must name a TOML file, got nothing"),
        (["bench", "--config", " "], "--config: must name a TOML file, got nothing"),
        (["bench", "-c", "0"], "--concurrency: must be at least 1, got 0"),
        (["bench", "-c", "-3"], "--concurrency: must be at least 1, got -3"),
        (["bench", "-d", "0"], "--duration: must be above 0, got 0"),
        (["bench", "-d", "-1"], "--duration: must be above 0, got -1"),
        (["bench", "-d", "nan"], "--duration: must be above 0, got nan"),
        (["bench", "-d", "inf"], "--duration: must be above 0, got inf"),
        (["bench", "--warmup", "inf"], "--warmup: must be at least 0, got inf"),
        (["bench", "--batch-dim", "x"], "--batch-dim: expected a number, got 'x'"),
        (["bench", "--scenario", "nosuch"], "--scenario: invalid choice: 'nosuch' (choose "
         "from 'autoscale', "),
        (["bench", "--execution", "gpu"], "--execution: invalid choice: 'gpu'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    """Exit status 2 and a line naming the argument: a port past 65535 was bound
    modulo 65536 (70000: 4464), -c 0 ran 256 callers, -d -1 reported nonsense. One
    line, saying where the options are listed: argparse printed its usage synopsis
    above it (a dozen lines for bench)."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert message in line
    command = " ".join(["trioserve", *argv[:1]])
    assert line.startswith(f"{command}: error: argument ") or not argv
    assert line.endswith(f"; see {command} --help")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "cache", "-d", "5"],
         "-d does not apply to --scenario cache: its traces are fixed"),
        (["--scenario", "fair", "--model", "minilm"],
         "--model does not apply to --scenario fair: it brings its own configuration"),
        (["--scenario", "gateway", "-c", "8"], "--concurrency does not apply to --scenario"),
        (["--scenario", "faults", "--config", "x.toml"], "--config does not apply"),
        (["--url", "http://127.0.0.1:1", "--replicas", "2"],
         "--replicas acts in process only: with --url the server's own configuration"),
        (["--url", "http://127.0.0.1:1", "--config", "x.toml"], "--config acts in process only"),
        (["--url", "http://127.0.0.1:1", "--execution", "thread"],
         "--execution acts in process only"),
        (["--stream"], "--stream applies with --url only"),
        (["--batch-dim", "4"], "--batch-dim applies with --url only"),
    ],
)
def test_a_bench_option_that_would_be_ignored_is_a_usage_error(argv, message, capsys):
    """Each was silently ignored, and the figures read as the option's."""
    with pytest.raises(SystemExit) as done:
        main(["bench", *argv])
    assert done.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"trioserve: error: bench: {message}")
    assert line.endswith("; see trioserve bench --help")


@pytest.mark.parametrize("where", ["folder", "under a file"])
def test_a_bench_json_path_that_cannot_be_written_is_refused_before_the_run(
    where, tmp_path, capsys, monkeypatch
):
    """``--json`` naming a folder, or a path under a file, was found only when the
    figures were written: after the whole run, as a traceback, exit 1. Now a usage
    error (exit 2) before any load runs."""
    import trioserve._bench

    def never(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(trioserve._bench, "main_in_process", never)
    (tmp_path / "f").write_text("")
    path = tmp_path if where == "folder" else tmp_path / "f" / "x.json"
    with pytest.raises(SystemExit) as done:
        main(["bench", "--model", "echo", "--json", str(path)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    why = "is a folder: name a file" if where == "folder" else "cannot write there: "
    assert f"bench: --json {path}: {why}" in err
    assert "Traceback" not in err


def test_a_bench_json_path_that_can_be_written_is_left_as_it_was(tmp_path, monkeypatch):
    """The check writes nothing: a new path's folders are made (as the bench would),
    no file is left, and an existing file keeps its content."""
    import trioserve._bench

    ran = []
    monkeypatch.setattr(trioserve._bench, "main_in_process", lambda *a: ran.append(a) or 0)
    new = tmp_path / "a" / "b" / "x.json"
    old = tmp_path / "old.json"
    old.write_text("kept")
    for path in (new, old):
        assert main(["bench", "--model", "echo", "--json", str(path)]) == 0
    assert [a[2] for a in ran] == [str(new), str(old)]
    assert new.parent.is_dir()
    assert not new.exists()
    assert old.read_text() == "kept"


class _ClosedPipe:
    """A stdout whose reader has gone: every write fails, as ``| head -1``'s does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        pass


def test_serve_reports_cannot_listen_only_when_binding_failed(tmp_path, capsys, monkeypatch):
    """Any OSError while serving was reported as a failure to bind: the banner
    written to a closed pipe gave "cannot listen on 127.0.0.1:0: [Errno 32] Broken
    pipe", exit 1, with the address bound and served. That error now goes up as
    itself; a bind failure is still one line (tests/test_config.py)."""
    path = tmp_path / "echo.toml"
    path.write_bytes(b'[models.e]\nbackend = "echo"\n')
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(BaseExceptionGroup) as failed:
        main(["serve", "--config", str(path), "--host", "127.0.0.1", "--port", "0"])
    broken, rest = failed.value.split(BrokenPipeError)
    assert broken is not None
    assert rest is None
    assert "cannot listen" not in capsys.readouterr().err


@pytest.mark.parametrize(("given", "host"), [("[::1]", "::1"), ("::1", "::1"), ("h", "h")])
def test_serve_takes_an_ipv6_host_in_brackets_as_urls_write_it(given, host):
    """``--host [::1]``, as the banner's URL writes it, failed: "Name or service not
    known"."""
    from trioserve.cli import _parser

    assert _parser().parse_args(["serve", "--host", given]).host == host


def test_cannot_listen_writes_an_ipv6_address_in_brackets(capsys):
    """"cannot listen on fe80::1:0" did not say where the address ends and the port
    begins."""
    import trioserve
    from trioserve.transport._main import _cannot_listen

    cfg = trioserve.Config(models=(trioserve.ModelConfig(name="e", backend="echo"),))
    exc = OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    assert _cannot_listen(exc, cfg, "fe80::1", 0) == 1
    assert _cannot_listen(exc, cfg, None, None) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("trioserve: cannot listen on [fe80::1]:0: [Errno 99] ")
    assert lines[1].startswith("trioserve: cannot listen on 127.0.0.1:8000: ")


def test_a_bench_against_a_server_that_is_not_there_says_so_in_a_line(capsys):
    code = main(["bench", "--url", "http://127.0.0.1:1", "-c", "1", "-d", "1", "--no-offline"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("trioserve: cannot reach http://127.0.0.1:1: ")
    assert "Traceback" not in err


def test_a_bench_of_a_model_there_is_not_names_what_there_is(capsys):
    """Not "invalid configuration" (the configuration is fine: --model is wrong), but
    what ``bench --url`` says of a model the server does not serve: the models that
    are served."""
    code = main(["bench", "--model", "nosuch", "-d", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "trioserve: cannot bench model 'nosuch': the built-in configuration does not "
        "serve it (serving: mlp, echo, minilm), and it is not a built-in backend (mlp, "
        "echo, sleep, minilm) or an import string 'module:attr'"
    ]


@pytest.mark.parametrize(
    ("model", "why"),
    [("nosuch_pkg_x:make", "ModuleNotFoundError: No module named 'nosuch_pkg_x' (put the "
      "directory that holds 'nosuch_pkg_x' on PYTHONPATH, or install it)"),
     ("os:nosuch", "AttributeError: module 'os' has no attribute 'nosuch'")],
)
def test_a_bench_of_an_import_string_that_does_not_import_says_why_in_a_line(
    model, why, capsys
):
    """It was "invalid configuration: models.M.backend: ...": a key of no file."""
    code = main(["bench", "--model", model, "-d", "1", "--no-offline"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"trioserve: cannot bench model {model!r}: the built-in configuration does not "
        f"serve it (serving: mlp, echo, minilm), and as an import string: cannot import "
        f"{model!r}: {why}"
    ]


@pytest.mark.parametrize("where", ["missing", "folder", "not TOML"])
def test_a_bench_config_that_cannot_be_read_is_one_line_naming_it(where, tmp_path, capsys):
    path = tmp_path / "x.toml"
    if where == "folder":
        path.mkdir()
    elif where == "not TOML":
        path.write_text("not toml [[[")
    code = main(["bench", "--config", str(path), "--model", "echo", "-d", "1"])
    assert code == 2
    why = {"missing": "cannot read config file: No such file or directory",
           "folder": "cannot read config file: Is a directory",
           "not TOML": "invalid TOML: "}[where]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"trioserve: invalid configuration: {path}: {why}")


@pytest.mark.parametrize("execution", ["process", "thread", "inline"])
def test_bench_takes_every_execution_a_model_config_takes(execution):
    """docs/benchmarks.md offers ``--execution thread|process|inline``: ``process``
    (the built-in mlp's own) was refused as an invalid choice."""
    from trioserve.cli import _parser

    assert _parser().parse_args(["bench", "--execution", execution]).execution == execution


# ---------------------------------------------------------------- the docs' commands
ROOT = Path(__file__).resolve().parent.parent
#: Options the docs name that are another program's: Triton's (docs/gateway.md).
FOREIGN = {"--model-control-mode"}


def _code(text: str) -> list[str]:
    """The code in a Markdown page: lines of fenced and indented blocks, and inline
    spans (a span that wraps a line joined up), each without its ``#`` comment."""
    fenced = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    pieces = [line for block in fenced for line in block.splitlines()]
    pieces += [line for line in prose.splitlines() if line.startswith("    ")]
    prose = re.sub(r"^    .*$", "", prose, flags=re.MULTILINE)
    pieces += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [p.split(" #")[0] for p in pieces]


def _options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each command's option strings (``""``: the program's own)."""
    out = {"": set()}
    for action in parser._actions:
        out[""] |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {o for a in sub._actions for o in a.option_strings}
    return out


def _uses(pages: list[Path], program: str) -> list[tuple[str, str, list[str]]]:
    """(page, command, the options after it) of the last use of ``program`` (a pattern
    whose group is the command, if any) in the pages' code; a span of options alone
    (``--replicas N``) is a use of no command in particular, ``"*"``."""
    uses = []
    for page in pages:
        for piece in _code(page.read_text()):
            found = re.match(r".*" + program + r"(.*)", piece)  # its last use
            if found is not None:
                command, rest = found[1] or "", found[2]
            elif piece.startswith("-"):
                command, rest = "*", piece
            else:
                continue
            options = re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest)
            uses.append((page.name, command, [o for o in options if o not in FOREIGN]))
    return uses


def test_every_option_the_docs_use_is_the_commands_own():
    """Each ``trioserve`` command line in README.md and docs/ (``make bench ARGS=``
    too) names only options its command has, and ``--scenario`` only scenarios there
    are; each ``python -m fuzz`` line in docs/fuzzing.md only options fuzz has, and
    that page all of them."""
    from trioserve.cli import _parser

    from fuzz._cli import _parser as fuzz_parser

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    own = _options(_parser())
    own["*"] = own["serve"] | own["bench"]
    uses = _uses(
        [p for p in pages if p.name != "fuzzing.md"], r"(?:\btrioserve|\bmake)(?: (serve|bench)\b)?"
    )
    assert sum(bool(options) for _, _, options in uses) > 20
    for page, command, options in uses:
        assert set(options) <= own[command], (page, command, options)
    fuzz_own = _options(fuzz_parser())[""]
    fuzz_uses = _uses([ROOT / "docs" / "fuzzing.md"], r"python -m fuzz()")
    assert sum(bool(options) for _, _, options in fuzz_uses) > 10
    for page, _, options in fuzz_uses:
        assert set(options) <= fuzz_own, (page, options)
    # and docs/fuzzing.md shows every option fuzz has
    assert fuzz_own - {"-h", "--help"} <= {o for _, _, opts in fuzz_uses for o in opts}
    for page in pages:
        code = " ".join(_code(page.read_text()))
        for name in re.findall(r"--scenario ([a-z][a-z-]*)", code):
            assert name in SCENARIOS, (page.name, name)


def test_the_readme_lists_every_bench_scenario():
    """README.md's ``bench --scenario`` line and the list after it name each scenario
    of ``trioserve bench --scenario`` once, and no other."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("bench --scenario") :].split("\n\n")[0]
    listed = re.findall(r"[a-z][a-z-]*", block.replace("bench --scenario", "").replace("also:", ""))
    assert sorted(listed) == sorted(SCENARIOS)


@pytest.mark.parametrize("keyless", [True, False])
async def test_the_banners_curl_line_carries_a_key_when_one_is_needed(keyless):
    """Without a default tenant the pasted curl line was answered 401: it now sends
    ``Authorization: Bearer KEY`` and says that KEY is a tenant's API key."""
    import trioserve
    from trioserve.transport._gateway import Gateway
    from trioserve.transport._main import banner

    tenants = (
        (trioserve.TenantConfig(name="demo", default=True),)
        if keyless
        else (trioserve.TenantConfig(name="acme", api_keys=("secret-key-1",)),)
    )
    cfg = trioserve.Config(
        models=(trioserve.ModelConfig(name="e", backend="echo"),), tenants=tenants
    )
    async with trioserve.open_runtime(cfg) as rt:
        gateway = Gateway(rt)
        gateway.addresses = [("127.0.0.1", 8321)]
        text = banner(gateway)
    curl = text.splitlines()[-1]
    assert curl.startswith("    curl -s http://127.0.0.1:8321/v2/models/e/infer ")
    assert "secret-key-1" not in text
    if keyless:
        assert text.splitlines()[-2] == "  try it:"
        assert "Authorization" not in curl
    else:
        assert text.splitlines()[-2] == "  try it, with one of a tenant's api_keys for KEY:"
        assert " -H 'Authorization: Bearer KEY' -d '" in curl


async def test_the_banners_curl_line_works_for_any_model_name_and_input_name():
    """The curl line put the model's name in the URL as it is and the body in single
    quotes: a name with a space, ``?`` or ``#`` (names are any path segment) made a
    line curl read as two URLs or another path, and an input named with a quote broke
    the shell's quoting. Split as a shell splits it, the line now asks the server for
    that model and is answered 200."""
    import shlex

    import trioserve
    from http_helpers import config, serving
    from trioserve.transport._client import HttpClient
    from trioserve.transport._main import banner

    quoted = trioserve.TensorSpec(name="it's", datatype="FP32", shape=(-1,))
    backend = trioserve.CallableBackend(
        lambda items: [{"y": it["it's"]} for it in items],
        inputs=[quoted],
        outputs=[trioserve.TensorSpec(name="y", datatype="FP32", shape=(-1,))],
        execution="inline",
    )
    cfg = config(trioserve.ModelConfig(name="a b?#é", backend=backend, max_wait_ms=0.0))
    async with serving(cfg) as gw:
        argv = shlex.split(banner(gw).splitlines()[-1])
        assert argv[:2] == ["curl", "-s"]
        url, body = argv[2], argv[argv.index("-d") + 1]
        assert url.startswith(gw.url)
        client = HttpClient(gw.url)
        try:
            answer = await client.request("POST", url[len(gw.url):], body.encode())
        finally:
            await client.aclose()
    assert answer.status == 200, answer.body
    assert answer.json()["model_name"] == "a b?#é"


@pytest.mark.parametrize(
    "datatype", ["BOOL", "UINT8", "UINT64", "INT8", "INT64", "FP16", "FP64", "BYTES"]
)
async def test_the_banners_curl_line_is_served_for_every_input_datatype(datatype):
    """The curl line wrote the sample's zeros as floats whatever the input's
    datatype (``"data":[0.0, ...]``), which the server refuses for BOOL and the
    integer datatypes (400, "expected BOOL values, got floats"). Each datatype's
    sample is now of its own kind (``false``, ``0``), and the line is answered 200."""
    import shlex

    import trioserve
    from http_helpers import config, serving
    from trioserve.transport._client import HttpClient
    from trioserve.transport._main import banner

    backend = trioserve.CallableBackend(
        lambda items: [{"y": it["x"]} for it in items],
        inputs=[trioserve.TensorSpec(name="x", datatype=datatype, shape=(2,))],
        outputs=[trioserve.TensorSpec(name="y", datatype=datatype, shape=(2,))],
        execution="inline",
    )
    cfg = config(trioserve.ModelConfig(name="m", backend=backend, max_wait_ms=0.0))
    async with serving(cfg) as gw:
        argv = shlex.split(banner(gw).splitlines()[-1])
        url, body = argv[2], argv[argv.index("-d") + 1]
        client = HttpClient(gw.url)
        try:
            answer = await client.request("POST", url[len(gw.url):], body.encode())
        finally:
            await client.aclose()
    assert answer.status == 200, answer.body
    assert answer.json()["outputs"][0]["datatype"] == datatype


class _TwoAddresses(trio.abc.HostnameResolver):
    """Resolves every name as a dual-stack ``localhost`` does, to two addresses
    (here both IPv4 loopback, which every test machine has)."""

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        return [
            (trio.socket.AF_INET, trio.socket.SOCK_STREAM, 6, "", (a, port))
            for a in ("127.0.0.1", "127.0.0.2")
        ]

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


async def test_port_0_on_a_host_of_several_addresses_listens_on_one_port():
    """``serve --host localhost --port 0`` where localhost is 127.0.0.1 and ::1:
    trio gave each address its own free port, and the banner names the first, so
    the URL printed did not reach the server at the other address (or reached
    another process there). Every address now listens on the one port printed."""
    import trioserve
    from trioserve.transport import open_listeners

    trio.socket.set_custom_hostname_resolver(_TwoAddresses())
    try:
        listeners = await open_listeners(trioserve.ServerConfig(), "both", 0)
    finally:
        trio.socket.set_custom_hostname_resolver(None)
    try:
        names = [ls.socket.getsockname() for ls in listeners]
        assert [host for host, _ in names] == ["127.0.0.1", "127.0.0.2"]
        port = names[0][1]
        assert port != 0
        assert [p for _, p in names] == [port, port]
        for host, _ in names:  # each accepts a connection on that port
            stream = await trio.open_tcp_stream(host, port)
            await stream.aclose()
    finally:
        for ls in listeners:
            await ls.aclose()


def test_serve_writes_progress_to_stdout_and_warnings_named_to_stderr(capsys):
    """While serving, a warning (max_connections over ulimit -n, an actor's crash)
    was written to stderr bare, unlike every other line of the command; now
    ``trioserve: WARNING: ...``. Progress stays on stdout, once."""
    import logging

    from trioserve.transport._main import _progress_shown

    log = logging.getLogger("trioserve.transport")
    with _progress_shown():
        logging.getLogger("trioserve").info("model %r: ready", "m")
        log.warning("server.max_connections (%d) is not below the open-file limit", 9)
        log.error("accept failed")
    logging.getLogger("trioserve").warning("after serving: not ours to write")
    out, err = capsys.readouterr()
    assert out == "trioserve: model 'm': ready\n"
    assert err.splitlines()[:2] == [
        "trioserve: WARNING: server.max_connections (9) is not below the open-file limit",
        "trioserve: ERROR: accept failed",
    ]
