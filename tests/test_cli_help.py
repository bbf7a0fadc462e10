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
