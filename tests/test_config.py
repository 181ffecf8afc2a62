import os
import ssl
import subprocess
import tomllib

import pytest
from conftest import TAPE

from tape.protocol.errors import ProtocolError
from tape.protocol.linkauth import LinkKeys
from tape.runtime.config import ConfigError, default, default_toml, load, parse


def test_default_config_is_a_loopback_cluster(tmp_path):
    cfg = default(tmp_path)
    assert [n.role for n in cfg.nodes] == ["sequencer", "sequencer", "rewinder", "rewinder"]  # leader + standby
    assert cfg.interface == "127.0.0.1" and cfg.group == "239.77.0.1"
    assert default(tmp_path).port == cfg.port  # fixed: separate processes agree
    assert cfg.max_packet == 8972  # no frame limits a datagram on loopback: a jumbo frame's packets
    assert cfg.seal == "blake3" and cfg.stream_auth.algorithm == 1  # which BLAKE3 hashes faster than BLAKE2b
    assert parse(tomllib.loads(default_toml("/tmp/x", max_packet=2000))).max_packet == 2000
    assert cfg.batch_interval_ms == 10  # nine processes on two cores: batches paced while messages come fast
    doc = tomllib.loads(default_toml("/tmp/x"))
    del doc["stream"]["batch_interval_ms"]
    assert parse(doc).batch_interval_ms == 0  # a config that does not ask for pacing gets none


def test_durability_flush_on_one_host_replicated_on_a_lan(tmp_path):
    """One host's voters share one power supply: only flushed records survive its loss. A LAN's
    voters' journals flush in the background."""
    one = parse(tomllib.loads(default_toml(tmp_path / "one")))
    assert one.durability == "flush"
    lan = parse(tomllib.loads(default_toml(tmp_path / "lan", replicas=3, sequencers=2, hosts=HOSTS)))
    assert lan.durability == "replicated"
    two = parse(tomllib.loads(default_toml(tmp_path / "two", replicas=3, sequencers=2, hosts=HOSTS[:2])))
    assert two.durability == "flush"  # voters sharing a host (its power) flush
    for cfg, flusher in ((one, False), (lan, True)):
        journal = cfg.open_journal(cfg.voters[0])
        assert (journal._flusher is not None) == flusher and (journal.fsync_interval == 0) != flusher
        journal.close()
    from tape.ops.cli.config_check import durability_warnings

    assert durability_warnings(one) == durability_warnings(lan) == []  # (one host flushes; a LAN's voters apart)
    one.durability = "replicated"
    [warning] = durability_warnings(one)
    assert "voters seq-a, rw-1, rw-2 on one host (127.0.0.1)" in warning and 'durability = "flush"' in warning


HOSTS = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.5"]


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
    (lambda d: d["journal"].update(durability="eventually"), "journal.durability: 'eventually'"),
    (lambda d: d["journal"].update(durability="replicated", fsync="batch"), "journal.fsync: with durability"),
    (lambda d: d["journal"].update(flush_ms=0), "journal.flush_ms: must be from 1"),
    (lambda d: d["stream"].update(seal="md5"), "stream.seal: 'md5'"),
    (lambda d: d["stream"].update(tick_ms=0), "stream.tick_ms: must be positive"),
    (lambda d: d["stream"].update(heartbeat_ms=-5), "stream.heartbeat_ms: must be positive"),
    (lambda d: d["stream"].update(batch_interval_ms=-1), "stream.batch_interval_ms: must be from 0"),
    (lambda d: d["stream"].update(batch_interval_ms=101), "stream.batch_interval_ms: must be from 0"),
    (lambda d: d.setdefault("timeouts", {}).update(client_resend_ms=0), "timeouts.client_resend_ms: must be"),
    (lambda d: d.setdefault("timeouts", {}).update(gap_request_ms=-1), "timeouts.gap_request_ms: must be"),
    (lambda d: d.pop("client"), "client: at least one"),
    (lambda d: d.setdefault("audit", {}).update(books_expected=-1), "audit.books_expected: must be from 0"),
    (lambda d: d.setdefault("audit", {}).update(books_expected=1 << 40), "audit.books_expected: must be from 0"),
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


# --- one config for every host (issue 14) ----------------------------------------------------



def lan(hosts=HOSTS):
    return parse(tomllib.loads(default_toml("/var/lib/tape", replicas=3, sequencers=2, hosts=hosts)))


def test_a_lan_config_puts_each_voter_on_its_own_host_and_each_node_on_its_hosts_interface():
    cfg = lan()
    where = {n.name: n.host for n in cfg.nodes}
    assert [where[v] for v in ("seq-a", "seq-b", "rw-1", "rw-2")] == HOSTS[:4]
    assert [where[r] for r in ("replica-A", "replica-B", "replica-C", "emitter")] == [HOSTS[4], *HOSTS[:3]]
    assert cfg.node("emitter").delivery == "quorum"  # replicas on hosts of their own: a quorum survives one
    assert all(cfg.interface_of(n) == n.host for n in cfg.nodes) and cfg.interface == ""
    assert cfg.max_packet == 1400  # an Ethernet frame's, unless the LAN is known to carry jumbo frames
    assert cfg.seal == "blake2b"  # at that size the faster
    assert cfg.interface_of(cfg.clients[0]) == HOSTS[3]
    three = {n.name: n.host for n in lan(HOSTS[:3]).nodes}  # fewer hosts than voters: round robin
    assert three["rw-2"] == HOSTS[0] and three["emitter"] in HOSTS[:3]


def test_an_interface_is_a_nodes_own_then_the_clusters_then_its_hosts():
    doc = tomllib.loads(default_toml("/x", hosts=HOSTS[:2]))
    doc["node"][0]["interface"] = "eth1"
    del doc["node"][1]["interface"]
    cfg = parse(doc)
    assert cfg.interface_of(cfg.nodes[0]) == "eth1" and cfg.interface_of(cfg.nodes[1]) == HOSTS[1]
    doc["stream"]["interface"] = "bond0"
    cfg = parse(doc)
    assert cfg.interface_of(cfg.nodes[0]) == "eth1" and cfg.interface_of(cfg.nodes[1]) == "bond0"


def test_config_check_finds_what_cannot_work_on_any_host(tmp_path):
    from tape.ops.cli.config_check import problems_anywhere

    assert problems_anywhere(lan()) == []
    doc = tomllib.loads(default_toml("/x", replicas=3, sequencers=2, hosts=HOSTS))
    doc["stream"]["interface"] = HOSTS[0]  # the runbook's old advice: every other host fails
    doc["node"][5]["metrics_port"] = doc["node"][0]["metrics_port"]  # replica-B on seq-a's host, one port
    found = problems_anywhere(parse(doc))
    assert len(found) == 2 and "is one host's address" in found[1] and "is also seq-a" in found[0]
    doc["stream"]["interface"] = "eth0"  # a name every host may have
    del doc["node"][5]["metrics_port"]
    assert problems_anywhere(parse(doc)) == []


def test_netif_resolves_this_hosts_addresses_and_interface_names_and_names_what_it_has():
    from tape.runtime import interfaces

    assert interfaces.resolve("lo") == "127.0.0.1" and interfaces.resolve("127.0.0.1") == "127.0.0.1"
    with pytest.raises(interfaces.InterfaceError, match=r"not an address of this host \(have: .*lo 127.0.0.1"):
        interfaces.resolve("203.0.113.77")
    with pytest.raises(interfaces.InterfaceError, match="no network interface of that name"):
        interfaces.resolve("nosuch0")
    assert interfaces.is_local("0.0.0.0") and not interfaces.is_local("203.0.113.77")


def test_the_embedded_default_keeps_its_keys_under_its_data_directory_owner_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(None)
    keys = tmp_path / "data" / "keys.json"
    assert keys.stat().st_mode & 0o777 == 0o600 and not (tmp_path / "keys.json").exists()
    assert [c.key for c in load(None).clients] == [c.key for c in cfg.clients]  # made once, then read
    assert sorted(p.name for p in keys.parent.iterdir()) == ["keys.json"]  # no temporary file left


def test_a_config_that_cannot_be_read_is_a_config_error_in_one_line(tmp_path):
    (tmp_path / "cluster.toml").mkdir()
    with pytest.raises(ConfigError, match=r"cannot read config file .*cluster.toml: Is a directory"):
        load(tmp_path / "cluster.toml")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "binary.toml")


@pytest.mark.parametrize("url", ["http://", "ftp://h/x", "http://h:99999/x", "http://h:port/x", "hooks.example/x"])
def test_a_webhook_url_the_sink_cannot_post_to_is_a_config_error_that_does_not_echo_it(url):
    doc = tomllib.loads(default_toml("/tmp/x", replicas=3))
    emitter = next(n for n in doc["node"] if n["role"] == "emitter")
    emitter.update(sinks=["jsonl", "webhook"], webhook_url=url)
    with pytest.raises(ConfigError, match="webhook_url: the webhook sink needs") as e:
        parse(doc)
    assert url not in str(e.value)
    emitter.update(webhook_url="https://hooks.example:8443/tape")
    assert parse(doc).node("emitter").webhook_url == "https://hooks.example:8443/tape"


@pytest.mark.parametrize("key, value", [("webhook_secret", "whsec_c2hvcnQ="), ("webhook_secret", "0123abcd" * 8),
                                        ("webhook_secret", "whsec_!!notbase64!!"),
                                        ("webhook_authorization", "Bearer x\r\nX-Injected: 1")])
def test_a_webhook_secret_or_authorization_that_cannot_be_used_is_refused_without_echo(key, value):
    doc = tomllib.loads(default_toml("/tmp/x", replicas=3))
    emitter = next(n for n in doc["node"] if n["role"] == "emitter")
    emitter.update(sinks=["jsonl", "webhook"], webhook_url="https://hooks.example/t", **{key: value})
    with pytest.raises(ConfigError, match=key) as e:
        parse(doc)
    assert value not in str(e.value)
    emitter.update(webhook_secret="whsec_" + "A" * 32, webhook_authorization="Bearer abc")
    assert parse(doc).node("emitter").webhook_authorization == "Bearer abc"


def test_config_check_warns_of_weak_repeated_missing_and_exposed_keys_and_prints_only_fingerprints(tmp_path):
    import io

    from rich.console import Console

    from tape.ops.cli.config_check import check, fingerprint
    from tape.runtime.config import new_keys

    keys = new_keys(2)
    path = tmp_path / "cluster.toml"
    path.write_text(default_toml(tmp_path, keys=keys))
    path.chmod(0o600)

    def checked() -> str:
        out = io.StringIO()
        assert check(str(path), None, Console(file=out, width=200)) == 0  # warnings do not fail the check
        return out.getvalue()

    clean = checked()
    assert "warning" not in clean and fingerprint(bytes.fromhex(keys["cluster"])) in clean
    assert not any(k in clean for k in (keys["stream"], keys["cluster"], *keys["clients"]))
    path.chmod(0o644)
    assert "holds keys and is readable by others (mode 0644): chmod 600" in checked()
    path.chmod(0o600)
    weak = dict(keys, cluster="ab" * 32, clients=[keys["clients"][0], keys["stream"]])
    path.write_text(default_toml(tmp_path, keys=weak))
    warned = checked()
    assert "cluster[0] (" in warned and "has 1 distinct bytes" in warned
    assert "client load1 is the same key as stream[0]" in warned
    path.write_text(default_toml(tmp_path, keys=dict(keys, listeners=None)))  # a keys file from before them
    assert "no [keys] listeners: every client holds the stream key" in checked()
    doc = tomllib.loads(default_toml(tmp_path, keys=keys))
    del doc["keys"]["cluster"], doc["client"][1]["key"]
    cfg = parse(doc)
    from tape.ops.cli.config_check import key_warnings
    assert key_warnings(cfg) == ["no [keys] cluster or links: those links are unauthenticated (docs/security.md)",
                                 "client load1 has no key: the sequencers take its batches unauthenticated"]


def test_a_malformed_key_is_refused_without_being_echoed():
    doc = tomllib.loads(default_toml("/x", clients=1, keys={"stream": "zz" + "ab" * 31, "cluster": "cd" * 32,
                                                           "clients": ["ef" * 32]}))
    with pytest.raises(ConfigError, match="keys.stream: not a hex key") as e:
        parse(doc)
    assert "zz" not in str(e.value) and "abab" not in str(e.value)


def test_each_hosts_file_holds_only_the_keys_its_nodes_need():
    from tape.ops.cli.config_out import host_texts
    from tape.runtime.config import new_keys

    hosts = [f"10.9.0.{i}" for i in range(1, 10)]  # voters, three replicas, the emitter, then the clients
    keys = new_keys(2)
    files = {h: parse(tomllib.loads(t)) for h, t in host_texts(hosts, keys, "/var/lib/tape", 2, 2, 3, 2).items()}
    assert len({tuple((n.name, n.host, n.metrics_port) for n in c.nodes) for c in files.values()}) == 1  # one cluster
    held = {h: (bool(c.stream_keys), sorted("/".join(pair) for pair in c.link_keys),
                [cl.name for cl in c.clients if cl.key]) for h, c in files.items()}
    assert not any(c.cluster_keys for c in files.values())  # the key every pair derives from stays home
    voters = ["rw-1/rw-2", "rw-1/seq-a", "rw-1/seq-b", "rw-2/seq-a", "rw-2/seq-b", "seq-a/seq-b"]
    assert held["10.9.0.1"] == (True, [p for p in voters if "seq-a" in p], ["load0", "load1"])  # seq-a checks
    assert held["10.9.0.3"] == (True, [p for p in voters if "rw-1" in p], [])  # every client's batches
    assert held["10.9.0.5"] == (True, ["emitter/replica-A"], [])  # a replica: its alert link only
    replicas = ["emitter/replica-A", "emitter/replica-B", "emitter/replica-C"]
    assert held["10.9.0.8"] == (False, replicas, [])  # the emitter alone: only the alert links' keys
    assert held["10.9.0.9"] == (False, [], ["load0"])  # a trading client: its own key and the listeners'
    client = files["10.9.0.9"]
    assert client.listener_keys == [bytes.fromhex(keys["listeners"])] and not client.stream_keys
    assert [bool(files[h].listener_keys) for h in ("10.9.0.1", "10.9.0.3", "10.9.0.5", "10.9.0.8")] == \
        [True, True, False, False]  # made by the leader, gap requests checked by rewinders; a replica needs none
    whole = parse(tomllib.loads(default_toml("/var/lib/tape", 2, 2, replicas=3, sequencers=2, hosts=hosts,
                                             keys=keys)))
    assert files["10.9.0.5"].pair_keys("emitter", "replica-A") == whole.pair_keys("emitter", "replica-A") \
        == files["10.9.0.8"].pair_keys("emitter", "replica-A")  # derived alike
    replica = files["10.9.0.5"]  # every key a replica's host holds: none opens a voter's link
    for key in [k for ks in replica.link_keys.values() for k in ks] + replica.stream_keys:
        for voter in whole.voters:
            with pytest.raises(ProtocolError, match="unknown_key"):
                whole.links_of(voter).accept(bytes(16), LinkKeys([key]).hello(bytes(16)), initiator=False)


def test_config_units_names_the_systemd_unit_of_each_node_that_lives_on_this_host(tmp_path):
    import io

    from tape.ops.cli.config_check import units

    path = tmp_path / "cluster.toml"
    path.write_text(default_toml("/x", replicas=3, sequencers=2, hosts=["127.0.0.1", "203.0.113.7"]))
    out = io.StringIO()
    assert units(str(path), out) == 0
    assert out.getvalue().split() == ["tape-sequencer@seq-a.service", "tape-rewinder@rw-1.service",
                                      "tape-replica@replica-A.service", "tape-replica@replica-C.service"]
    assert units(str(tmp_path / "missing.toml"), out) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user: root only")
def test_node_replace_run_as_root_leaves_the_empty_directory_the_nodes_own(tmp_path):
    import io

    from tape.ops.cli.node_tool import replace

    (tmp_path / "cluster.toml").write_text(default_toml(str(tmp_path / "data"), replicas=3, free=True))
    cfg = load(tmp_path / "cluster.toml")
    data = tmp_path / "data" / "rw-1"
    data.mkdir(parents=True)
    (data / "journal").write_text("x")
    os.chown(data, 4242, 4243)
    data.chmod(0o700)
    assert replace(cfg, "rw-1", io.StringIO()) == 0
    st = data.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4242, 4243, 0o700) and not any(data.iterdir())


def test_a_keys_file_is_made_owner_only_once_then_read_and_a_cluster_key_in_rotation_gives_each_pair_two(tmp_path):
    from tape.ops.cli.config_out import host_texts
    from tape.runtime.config import keys_file

    path = tmp_path / "build" / "keys.json"
    made = keys_file(path, 2)
    assert path.stat().st_mode & 0o777 == 0o600 and keys_file(path, 2) == made  # the same keys, written again
    with pytest.raises(ConfigError, match="keys for 2 clients, not 3"):
        keys_file(path, 3)
    hosts = [f"10.9.0.{i}" for i in range(1, 10)]
    old = parse(tomllib.loads(host_texts(hosts, made, "/d", 2, 2, 3, 2)["10.9.0.5"]))
    new_cluster = os.urandom(32).hex()
    rotating = parse(tomllib.loads(host_texts(hosts, {**made, "cluster": [new_cluster, made["cluster"]]}, "/d",
                                              2, 2, 3, 2)["10.9.0.5"]))
    pair = ("emitter", "replica-A")
    assert len(old.pair_keys(*pair)[0]) == 32 and rotating.pair_keys(*pair)[1] == old.pair_keys(*pair)[0]
    assert len(rotating.pair_keys(*pair)) == 2  # the new pair key signs, the old one still verifies


@pytest.mark.process  # (openssl makes the certificates; the CLI runs)
def test_metrics_tls_files_are_taken_beside_the_config_and_a_half_configured_tls_is_refused(tmp_path):
    from tape.ops.verification.certs import make_certificates

    base = default_toml("/x", replicas=0, sequencers=1)
    path = tmp_path / "cluster.toml"
    path.write_text(base + '\n[metrics]\ncertfile = "certs/node.pem"\nkeyfile = "certs/node.key"\n')
    cfg = load(path)
    assert cfg.certfile == str(tmp_path / "certs" / "node.pem")  # relative to the config's directory
    with pytest.raises(OSError):  # not there yet: a node stops at start (exit 2), naming the files
        cfg.metrics_tls
    make_certificates(tmp_path / "certs", ["node"], ip="127.0.0.1")
    assert cfg.metrics_tls.verify_mode == ssl.CERT_NONE  # HTTPS, no client certificate asked for
    for table, message in (('keyfile = "k.pem"', "need a certfile"),
                           ('certfile = "c.pem"\nclient_auth_required = true', "client_cafile")):
        with pytest.raises(ConfigError, match=message):
            parse(tomllib.loads(base + f"\n[metrics]\n{table}\n"))
    with_ca = base + '\n[metrics]\ncertfile = "c.pem"\nclient_cafile = "ca.pem"\n'
    path.write_text(with_ca)
    done = subprocess.run(TAPE + ["config", "prometheus", str(path), "--ca-file", "/p/ca.pem"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "cert_file, key_file (--cert-file --key-file)" in done.stderr
