"""The command line explains itself: every option of every subcommand has help text, and
`mergepipe demo --help` lists the demo's own options."""
from __future__ import annotations

import argparse

import pytest

from mergepipe.cli import build_parser, main


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _undocumented(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    for name, sub in _subparsers(parser):
        missing += _undocumented(sub, f"{prog} {name}")
    return missing


def test_every_option_of_every_subcommand_has_help_text():
    parser = build_parser()
    assert len(dict(_subparsers(parser))) >= 10  # the walk reaches the subcommands
    assert _undocumented(parser, "mergepipe") == []


def test_the_walk_finds_an_option_without_help():
    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers().add_parser("y")
    sub.add_argument("--budget")
    assert _undocumented(parser, "x") == ["x y --budget"]


def test_demo_help_shows_the_demo_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--preset", "--experts", "--dtype", "--tied", "--seed", "--quiet"):
        assert option in text, text
    assert "rest" not in text


def test_demo_runs_through_the_cli(tmp_path, capsys):
    assert main(["demo", str(tmp_path / "fam"), "--experts", "1", "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "fam").iterdir() if p.is_dir()) == ["base", "expert_0"]


def test_demo_option_names_are_the_demos():
    from mergepipe.commands.demo import DTYPES, PRESETS
    from mergepipe.commands.demo_args import DTYPE_NAMES, PRESET_NAMES
    assert sorted(PRESETS) == list(PRESET_NAMES) and sorted(DTYPES) == list(DTYPE_NAMES)


def test_the_cli_does_not_import_torch_to_parse():
    import subprocess
    import sys
    code = "import sys; from mergepipe.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("argv", [["demo", "--", "--help"], ["demo", "--", "-h"]])
def test_demo_help_as_the_cli_help_says_prints_help(argv, tmp_path, monkeypatch, capsys):
    """`mergepipe --help` says "see `mergepipe demo -- --help`": that wrote a demo family into
    a folder named `--help` (argparse kept the `--`, so `--help` became the output folder)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "--preset" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
