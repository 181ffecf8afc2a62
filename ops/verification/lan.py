"""Hosts on one machine: Linux network namespaces on a bridge, for LAN tests and drills.

    tape-<tag>-sw      the switch: a namespace holding the bridge br0 (multicast snooping off,
                       so that the group reaches every port without an IGMP querier)
    tape-<tag>-h1 ...  the hosts: a namespace each, eth0 = 10.X.Y.i/24 (a veth whose peer is
                       a port of br0), lo up, and the 224.0.0.0/4 route via eth0
    tape-<tag>-f1 ...  while a host's cable is impaired: the forwarder's namespace, between the
                       host's port and the switch (ops/verification/forwarder.py: delay, jitter, duplication)

Everything is made inside namespaces named with the LAN's tag, and nothing in the root
namespace: destroy() kills what runs in them and deletes them by name. A LanCluster is the
LocalCluster (ops/verification/local.py) of the default topology spread over those hosts with one config
file (`tape config --hosts`): each process runs in its host's namespace, and the harness
reads metrics from inside the namespace too (a thread that enters it).
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

from tape.ops.verification.local import LocalCluster
from tape.runtime.config import default_toml, load, new_keys

CLONE_NEWNET = 0x40000000
WEBHOOK_PORT = 8080  # the webhook receiver's, alone on its host
NETNS_DIR = Path("/run/netns")


class LanUnavailable(Exception):
    """This machine cannot make network namespaces (not root, or no `ip netns`)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise LanUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def in_netns(namespace: str, fn):
    """fn() run in a thread that entered `namespace` (the network namespace is per thread)."""
    out: dict = {}

    def enter() -> None:
        fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                out["error"] = OSError(ctypes.get_errno(), f"setns {namespace}")
                return
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except Exception as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class Lan:
    def __init__(self, hosts: int, tag: str | None = None):
        rng = random.Random(tag)
        self.tag = tag or f"{random.SystemRandom().randrange(16 ** 5):05x}"
        subnet = f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 250)}"
        self.switch = f"tape-{self.tag}-sw"
        self.hosts = [f"tape-{self.tag}-h{i}" for i in range(1, hosts + 1)]
        self.addresses = [f"{subnet}.{i}" for i in range(1, hosts + 1)]
        self.made: list[str] = []
        self.forwarders: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> Lan:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        self._add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.hosts, self.addresses), 1):
            self._add(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            # Checksums computed when sent, not left to an offload that a forwarder copying raw frames
            # (ops/verification/forwarder.py) would carry on unfinished: the receiver would drop every packet.
            subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", "eth0", "tx", "off"], capture_output=True)
            self.link(i - 1, up=True)

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, host: int, up: bool) -> None:
        """A host's cable: down (its multicast route goes with it) or up (the route put back, as
        the host's network configuration would)."""
        ns = self.hosts[host]
        _ip("-n", ns, "link", "set", "eth0", "up" if up else "down")
        if up:
            _ip("-n", ns, "route", "replace", "224.0.0.0/4", "dev", "eth0")

    def loss(self, host: int, percent: int) -> None:
        """Drop `percent`% of every packet in and out of a host (nftables; 0 removes the rules)."""
        ns = self.hosts[host]
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "tape_loss"],
                       capture_output=True)
        if percent:
            rules = "table inet tape_loss {\n" + "".join(
                f"  chain {hook} {{ type filter hook {hook}put priority 0; numgen random mod 100 < {percent} drop; }}\n"
                for hook in ("in", "out")) + "}\n"
            done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise LanUnavailable(f"nft in {ns}: {done.stderr.strip() or 'not installed'}")

    def impair(self, host: int, delay_ms: float = 0.0, jitter_ms: float = 0.0, dup: float = 0.0,
               seed: int = 1) -> None:
        """Put a forwarder on a host's cable: its switch port moves into a namespace of its own,
        joined to the bridge by a new veth, and ops/verification/forwarder.py copies frames between the two."""
        i, fwd = host + 1, f"tape-{self.tag}-f{host + 1}"
        self._add(fwd)
        _ip("-n", self.switch, "link", "set", f"port{i}", "nomaster")
        _ip("-n", self.switch, "link", "set", f"port{i}", "netns", fwd)
        _ip("-n", fwd, "link", "add", f"up{i}", "type", "veth", "peer", "name", f"fport{i}", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"fport{i}", "master", "br0", "up")
        for dev in (f"port{i}", f"up{i}"):
            _ip("-n", fwd, "link", "set", dev, "up", "promisc", "on")
        self.forwarders[host] = subprocess.Popen(
            ["ip", "netns", "exec", fwd, sys.executable, "-m", "tape.ops.verification.forwarder", f"port{i}", f"up{i}",
             "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), "--dup", str(dup), "--seed", str(seed)])

    def unimpair(self, host: int) -> None:
        """The plain cable back: the forwarder stopped, the port returned to the bridge."""
        proc = self.forwarders.pop(host)
        proc.terminate()
        proc.wait(timeout=10)
        i, fwd = host + 1, f"tape-{self.tag}-f{host + 1}"
        _ip("-n", fwd, "link", "set", f"port{i}", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
        _ip("netns", "del", fwd)  # (its veth to the bridge goes with it)
        self.made.remove(fwd)

    def host_of(self, address: str) -> str:
        return self.hosts[self.addresses.index(address)]

    def destroy(self) -> None:
        """Kill whatever still runs in our namespaces, then delete them (their veths go too)."""
        for ns in reversed(self.made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []


class LanCluster(LocalCluster):
    """The default topology (2 sequencers, 2 rewinders, 3 replicas, the emitter, a load client)
    over a Lan's hosts, from one config file; the local cluster's controls work unchanged."""

    def __init__(self, root: Path, lan: Lan, extra: str = "", delivery: str = "first", webhook: bool = False,
                 max_packet: int | None = None, durability: str | None = None):
        """`webhook`: the emitter also posts every alert to a receiver (ops/verification/webhook_receiver.py) on
        the LAN's last host, which then has nothing else."""
        self.lan = lan
        self.webhook = webhook
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.config_path = root / "cluster.toml"
        hosts = lan.addresses[:-1] if webhook else lan.addresses
        text = default_toml(root / "data", clients=1, replicas=3, sequencers=2, keys=new_keys(1),
                            hosts=hosts, delivery=delivery, max_packet=max_packet, durability=durability)
        if webhook:
            self.webhook_url = f"http://{lan.addresses[-1]}:{WEBHOOK_PORT}/alerts"
            text = text.replace('role = "emitter"', f'role = "emitter"\nsinks = ["jsonl", "webhook"]\n'
                                f'webhook_url = "{self.webhook_url}"\nwebhook_timeout_ms = 1000')
        rng = random.SystemRandom()
        group = f"239.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
        text = text.replace('group = "239.77.0.1"', f'group = "{group}"')
        self.config_path.write_text(text.replace("[journal]", extra + "\n[journal]") if extra else text)
        self.cfg = load(self.config_path)
        self.procs, self.logs, self.started, self.let_go = {}, {}, {}, set()

    def start_all(self, drop: float = 0.0, emitter_args: tuple = ()) -> None:
        if self.webhook:
            self.posts = self.root / "webhook-posts.jsonl"
            self.procs["webhook"] = subprocess.Popen(
                ["ip", "netns", "exec", self.lan.hosts[-1], sys.executable,
                 "-m", "tape.ops.verification.webhook_receiver",
                 "--host", self.lan.addresses[-1], "--port", str(WEBHOOK_PORT), "--out", str(self.posts)])
            self.let_go.add("webhook")  # (not a node: the LAN's end kills it)
        super().start_all(drop, emitter_args)

    def namespace(self, name: str) -> str:
        """The host namespace `name` (a node, or the load client) runs in."""
        nodes = {n.name: n.host for n in self.cfg.nodes}
        return self.lan.host_of(nodes.get(name) or self.cfg.clients[0].interface)

    def command(self, name: str, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(name), *super().command(name, args)]

    def fetch(self, name: str, port: int, timeout: float) -> bytes:
        host = self.cfg.node(name).host
        return in_netns(self.namespace(name), lambda: LocalCluster.fetch_url(host, port, timeout))
