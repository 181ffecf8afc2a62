import os
import re
import subprocess

import pytest
from conftest import TAPE

from tape.ops.cli.main import build_parser
from tape.ops.verification.load import TURN_TRADES, turn_trades
from tape.protocol.extensions import PURE


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
def test_a_node_started_where_its_address_is_not_says_so_and_exits_3(tmp_path):
    """A LAN config's node started where its address does not exist (yet: an interface not up at
    boot, or the wrong host): one line naming the node and this host's addresses, exit 3 (systemd
    tries again; a restart loop alerts), no traceback. A node the config lacks is exit 2."""
    cfg = tmp_path / "lan.toml"
    made = subprocess.run(TAPE + ["config", "--hosts", "203.0.113.1,203.0.113.2", "--data", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    cfg.write_text(made.stdout)
    checked = subprocess.run(TAPE + ["config", "check", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0 and "elsewhere" in checked.stdout  # valid, and nothing of it lives here
    for role, node in (("sequencer", "seq-a"), ("rewinder", "rw-1"), ("replica", "replica-A")):
        out = subprocess.run(TAPE + [role, "--config", str(cfg), "--node", node], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 3, out.stderr
        assert f"node {node}: host 203.0.113." in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(TAPE + ["rewinder", "--config", str(cfg), "--node", "rw-9"], capture_output=True, text=True)
    assert out.returncode == 2 and "rw-9" in out.stderr and "Traceback" not in out.stderr
    checked = subprocess.run(TAPE + ["config", "check", str(cfg), "--node", "seq-a"], capture_output=True,
                             text=True)
    assert checked.returncode == 2 and "seq-a: host 203.0.113.1 is not an address of this host" in checked.stdout


def test_the_load_submits_whole_datagrams_a_turn():
    """Each client's turn is whole datagrams: one of 174 trades (8,972-byte packets), seven of
    26 (1,400-byte), one larger than a turn whole; never a full datagram and a stub."""
    assert [turn_trades(n) for n in (174, 26, 300, 1)] == [174, 182, 300, TURN_TRADES]
    assert all(turn_trades(n) % n == 0 for n in range(1, 400))


@pytest.mark.process
def test_version_says_whether_the_c_speedups_are_on():
    on = subprocess.run(TAPE + ["--version"], capture_output=True, text=True, check=True).stdout
    off = subprocess.run(TAPE + ["--version"], capture_output=True, text=True, check=True,
                         env={**os.environ, "TAPE_PURE": "1"}).stdout
    assert on.startswith("tape 0.") and "C speed-ups off for 5 of 5 (tape.protocol._speedups" in off
    assert ("C speed-ups on" in on) != PURE  # make test-pure hides them in every process


@pytest.mark.process
def test_config_out_writes_a_private_file_a_host_and_a_sequencer_refuses_another_hosts(tmp_path):
    hosts = "203.0.113.1,203.0.113.2,203.0.113.3,203.0.113.4,203.0.113.5"
    made = subprocess.run(TAPE + ["config", "--hosts", hosts, "--data", str(tmp_path), "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, check=True)
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert files == [f"{h}.toml" for h in hosts.split(",")] + ["prometheus.yml"]
    assert all((tmp_path / "c" / f).stat().st_mode & 0o777 == 0o600 for f in files[:-1])
    assert "203.0.113.5.toml: replica-A, load1; keys stream[0] " in made.stdout
    assert not re.search(r"[0-9a-f]{64}", made.stdout)  # fingerprints only
    out = subprocess.run(TAPE + ["sequencer", "--config", str(tmp_path / "c" / "203.0.113.5.toml"), "--node", "seq-a"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no link key shared with seq-b, rw-1, rw-2 in this file" in out.stderr, out.stderr


@pytest.mark.process
def test_config_keys_prints_the_schemas_reference():
    from tape.ops.cli.config_keys import key_reference

    printed = subprocess.run(TAPE + ["config", "keys"], capture_output=True, text=True, check=True).stdout
    assert printed == key_reference() and "| [timeouts] `election_ms` | `300` |" in printed
