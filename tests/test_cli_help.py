"""Every subcommand answers --help (argparse formats every help string), and `strata` alone lists them."""

from __future__ import annotations

import pytest

from strata.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: strata" in capsys.readouterr().out


def test_usage_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["nonsense"]) == 2
