"""Every command's --help prints and exits 0 (help texts are %-formatted by argparse)."""

from __future__ import annotations

import pytest
from trioserve.cli import main


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


def test_version_prints_and_exits_zero(capsys):
    import trioserve

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"trioserve {trioserve.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "--port: must be at least 0 and at most 65535, got 70000"),
        (["serve", "--port", "-1"], "--port: must be at least 0 and at most 65535, got -1"),
        (["serve", "--host", ""], "--host: must be an address or host name, got nothing"),
        (["bench", "-c", "0"], "--concurrency: must be at least 1, got 0"),
        (["bench", "-d", "-1"], "--duration: must be above 0, got -1"),
        (["bench", "-d", "nan"], "--duration: must be above 0, got nan"),
        (["bench", "-d", "inf"], "--duration: must be above 0, got inf"),
        (["bench", "--warmup", "inf"], "--warmup: must be at least 0, got inf"),
        (["bench", "--batch-dim", "x"], "--batch-dim: expected a number, got 'x'"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    """Exit status 2 and a line naming the argument: a port past 65535 was bound
    modulo 65536 (70000: 4464), -c 0 ran 256 callers, -d -1 reported nonsense."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bench_against_a_server_that_is_not_there_says_so_in_a_line(capsys):
    code = main(["bench", "--url", "http://127.0.0.1:1", "-c", "1", "-d", "1", "--no-offline"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("trioserve: cannot reach http://127.0.0.1:1: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("execution", ["process", "thread", "inline"])
def test_bench_takes_every_execution_a_model_config_takes(execution):
    """docs/benchmarks.md offers ``--execution thread|process|inline``: ``process``
    (the built-in mlp's own) was refused as an invalid choice."""
    from trioserve.cli import _parser

    assert _parser().parse_args(["bench", "--execution", execution]).execution == execution
