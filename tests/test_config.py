import tomllib

import pytest

from tape.ops.config import ConfigError, default, default_toml, load, parse


def test_default_config_is_a_loopback_cluster():
    cfg = default("/tmp/x")
    assert [n.role for n in cfg.nodes] == ["sequencer", "sequencer", "rewinder", "rewinder"]  # leader + standby
    assert cfg.interface == "127.0.0.1" and cfg.group == "239.77.0.1"
    assert default("/tmp/x").port == cfg.port  # fixed: separate processes agree


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["stream"].pop("group"), "stream.group: missing"),
    (lambda d: d["stream"].update(group="10.0.0.1"), "stream.group: 10.0.0.1 is not a multicast"),
    (lambda d: d["stream"].update(port=70000), "stream.port: port 70000"),
    (lambda d: d["stream"].update(port="x"), "stream.port: expected int"),
    (lambda d: d["node"][1].update(role="king"), "node[1].role"),
    (lambda d: d["node"][2].update(name="rw-1"), "node[2].name: 'rw-1' appears twice"),
    (lambda d: d["node"][1].pop("gapfill_port"), "node[1].gapfill_port: missing"),
    (lambda d: d.update(colour="blue"), "colour: unknown key"),
    (lambda d: d.update(session="WAY TOO LONG"), "session:"),
    (lambda d: d["journal"].update(fsync="sometimes"), "journal.fsync"),
    (lambda d: d.pop("client"), "client: at least one"),
])
def test_invalid_config_names_the_key(edit, key):
    doc = tomllib.loads(default_toml("/tmp/x"))
    edit(doc)
    with pytest.raises(ConfigError) as e:
        parse(doc)
    assert key in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("session = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)
