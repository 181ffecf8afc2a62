import subprocess

import pytest
from conftest import TAPE

from tape.ops.cli import build_parser


def subcommand_paths(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from subcommand_paths(sub, prefix + (name,))


PATHS = list(subcommand_paths(build_parser()))


def test_the_expected_commands_exist():
    assert {("demo",), ("journal", "dump"), ("journal", "verify"), ("bench", "protocol")} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_subcommand_has_help(path):
    out = subprocess.run(TAPE + list(path) + ["--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: tape" in out.stdout


def test_bad_arguments_give_one_clear_error():
    out = subprocess.run(TAPE + ["journal", "dump"], capture_output=True, text=True)
    assert out.returncode == 2 and "path" in out.stderr
    out = subprocess.run(TAPE + ["journal", "dump", "/nonexistent/journal"], capture_output=True, text=True)
    assert out.returncode == 1 and "no journal segments" in out.stderr and "Traceback" not in out.stderr
