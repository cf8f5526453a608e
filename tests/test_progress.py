"""Loading shows progress on a terminal only, and the CLI prints a one-line summary of the placement."""

from __future__ import annotations

from strata.cli import main
from strata.runtime import progress
from tiny import write_tiny_llama


def test_bar_counts_every_tensor_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    with progress.tensor_bar(3, enabled=True) as advance:
        for _ in range(3):
            advance()
    err = capsys.readouterr().err
    assert "3/3" in err and "tensors" in err  # the bar drew its final count on stderr


def test_no_bar_when_not_a_terminal(capsys):
    with progress.tensor_bar(3, enabled=True) as advance:
        advance()
    assert capsys.readouterr().err == ""


def test_run_prints_a_one_line_plan_summary(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "t.gguf")
    assert main(["run", "--model", str(model), "--prompt", "ab", "-n", "2", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("loaded llama, 2 layers x 4 experts") and "all weights in RAM" in err[0]
    assert main(["run", "--model", str(model), "--prompt", "ab", "-n", "2", "--json", "--experts-cache", "50%"]) == 0
    line = capsys.readouterr().err.splitlines()[0]
    assert "cache 4 of 8 experts" in line and "experts home ram" in line


def test_experts_read_into_ram_show_a_byte_bar_on_a_terminal(tmp_path, monkeypatch, capsys):
    import strata

    model = write_tiny_llama(tmp_path / "t.gguf")
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    engine = strata.load(str(model), progress=True, pin_experts="ram", experts_cache="0")
    engine.close()
    err = capsys.readouterr().err
    assert "reading experts into RAM" in err and "tensors" in err
