"""docs/runbook.md's commands are the CLI's: every subcommand and option it names exists, and a
test runs each of them (the runbook is written from what the tests do). Its shell blocks are run
as they stand by tests/test_deploy.py: each is marked with the name that test runs it by."""

import re
from pathlib import Path

import pytest
from hosts import runbook_blocks

from tape.ops.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = (ROOT / "docs" / "runbook.md").read_text()
BLOCKS = runbook_blocks()
DEPLOY = (ROOT / "tests" / "test_deploy.py").read_text()
IN_BLOCKS = {" ".join(line.split()) for text in BLOCKS.values() for line in text.splitlines()
             if line.startswith("tape ")}
COMMANDS = sorted({" ".join(c.split()) for c in re.findall(r"`(tape [^`]+)`", RUNBOOK)} | IN_BLOCKS)
TESTS = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_runbook.py"}
# Where a test drives a command through the Python function behind it rather than the CLI:
# command -> (test file, the call it makes).
THROUGH_PYTHON = {"tape sim --seeds N": ("test_sim.py", "sim.main(1, 2000")}


def words(command: str) -> list[str]:
    """The command's words after `tape`, up to a shell redirection."""
    ws = command.split()[1:]
    return ws[:ws.index(">")] if ">" in ws else ws


def resolve(ws: list[str]):
    """(the subcommand path, the parser that takes the options) for the command's words."""
    parser, path = build_parser(), []
    for w in ws:
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if w.startswith("-") or not subs or w not in subs[0].choices:
            break
        parser, path = subs[0].choices[w], [*path, w]
    return path, parser


def options(ws: list[str]) -> list[str]:
    return [w.split("=")[0] for w in ws if w.startswith("--")]


def test_the_runbook_names_commands():
    assert len(COMMANDS) > 15 and any(c.startswith("tape config check") for c in COMMANDS)


def test_every_shell_block_of_the_runbook_is_run_by_the_deploy_test():
    fences = re.findall(r"^ *```sh$", RUNBOOK, re.M)
    assert len(fences) == len(BLOCKS) >= 5, "a shell block without its <!-- run: NAME --> line, or a name twice"
    unrun = [name for name in BLOCKS if f'BLOCKS["{name}"]' not in DEPLOY]
    assert not unrun, f"blocks of docs/runbook.md that tests/test_deploy.py does not run: {unrun}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_and_option_the_runbook_names_exists(command):
    ws = words(command)
    path, parser = resolve(ws)
    assert path or options(ws), f"{command!r}: no such subcommand"  # (or an option of tape's own: --version)
    known = {o for a in parser._actions for o in a.option_strings}
    unknown = [o for o in options(ws) if o not in known]
    assert not unknown, f"{command!r}: tape {' '.join(path)} has no option {unknown}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_in_the_runbook_is_run_by_a_test(command):
    if command in IN_BLOCKS:
        return  # run as the runbook has it, by tests/test_deploy.py (checked above)
    if command in THROUGH_PYTHON:
        name, call = THROUGH_PYTHON[command]
        assert call in TESTS[name], f"{command!r}: {name} no longer makes {call!r}"
        return
    ws = words(command)
    path, _ = resolve(ws)
    needed = [f'"{w}"' for w in (*path, *options(ws))]
    runners = [name for name, text in TESTS.items() if "TAPE" in text and all(n in text for n in needed)]
    assert runners, f"{command!r}: no test runs tape {' '.join(path)} with {options(ws) or 'no options'}"
