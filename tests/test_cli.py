import subprocess

import pytest
from conftest import TAPE

from tape.ops.cli.main import build_parser
from tape.ops.verification.load import TURN_TRADES, turn_trades


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
def test_every_subcommand_has_help(path, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*path, "--help"])
    assert done.value.code == 0 and f"usage: tape {' '.join(path)}" in capsys.readouterr().out


@pytest.mark.process
def test_the_installed_command_prints_its_help():
    out = subprocess.run(TAPE + ["journal", "dump", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: tape journal dump" in out.stdout


@pytest.mark.process
def test_bad_arguments_give_one_clear_error():
    out = subprocess.run(TAPE + ["journal", "dump"], capture_output=True, text=True)
    assert out.returncode == 2 and "path" in out.stderr
    out = subprocess.run(TAPE + ["journal", "dump", "/nonexistent/journal"], capture_output=True, text=True)
    assert out.returncode == 1 and "no journal segments" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.process
def test_a_node_started_on_the_wrong_host_says_so_and_exits_2(tmp_path):
    """A LAN config's node started where its address does not exist: one CRITICAL line naming
    the node and this host's addresses, exit 2 (systemd does not restart it), no traceback."""
    cfg = tmp_path / "lan.toml"
    made = subprocess.run(TAPE + ["config", "--hosts", "203.0.113.1,203.0.113.2", "--data", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    cfg.write_text(made.stdout)
    checked = subprocess.run(TAPE + ["config", "check", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0 and "elsewhere" in checked.stdout  # valid, and nothing of it lives here
    for role, node in (("sequencer", "seq-a"), ("rewinder", "rw-1"), ("replica", "replica-A")):
        out = subprocess.run(TAPE + [role, "--config", str(cfg), "--node", node], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 2, out.stderr
        assert f"node {node}: host 203.0.113." in out.stderr and "Traceback" not in out.stderr
    checked = subprocess.run(TAPE + ["config", "check", str(cfg), "--node", "seq-a"], capture_output=True,
                             text=True)
    assert checked.returncode == 2 and "seq-a: host 203.0.113.1 is not an address of this host" in checked.stdout


def test_the_load_submits_whole_datagrams_a_turn():
    """Each client's turn is whole datagrams: one of 174 trades (8,972-byte packets), seven of
    26 (1,400-byte), one larger than a turn whole; never a full datagram and a stub."""
    assert [turn_trades(n) for n in (174, 26, 300, 1)] == [174, 182, 300, TURN_TRADES]
    assert all(turn_trades(n) % n == 0 for n in range(1, 400))
