"""Machines for a deploy test: each a network namespace host of a Lan (ops/verification/lan.py)
with a root file system of its own, so that what the runbook does to a host (a user added, a
virtual environment in /opt/tape, /etc/tape, /var/lib/tape, units in /etc/systemd/system)
happens on that host alone and never on this machine.

A host's root is an overlay: this machine's root file system below (read only through it), a
tmpfs above that takes every write, and fresh /run and /tmp. A holder process (`sleep`, chrooted
there) keeps the host's mount namespace; every command enters it and the host's network
namespace with nsenter. The release (the build machine's checkout, with dist/ and cluster/) is
mounted read-only at /srv/release. No systemd runs on such a host: /usr/local/sbin/systemctl is
tests/systemctl_stub.py, which starts the installed units as their files say. Killing what runs
in the namespace (Lan.destroy) unmounts it all."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

RELEASE = "/srv/release"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STUB = Path(__file__).with_name("systemctl_stub.py")
RUNBOOK = Path(__file__).resolve().parent.parent / "docs" / "runbook.md"
HOLD_S = 1800  # the holder sleeps at most this long: a test killed before its clean-up leaves no host for good


class Host:
    def __init__(self, namespace: str, address: str, scratch: Path, release: Path):
        self.namespace, self.address = namespace, address
        scratch.mkdir(parents=True)
        root = scratch / "root"
        boot = f"""
            mount -t tmpfs tmpfs {scratch}
            mkdir {scratch}/upper {scratch}/work {root}
            mount -t overlay overlay -o lowerdir=/,upperdir={scratch}/upper,workdir={scratch}/work {root}
            mount --rbind /dev {root}/dev
            mount -t proc proc {root}/proc
            mount --rbind /sys {root}/sys
            mount -t tmpfs -o mode=0755 tmpfs {root}/run
            mount -t tmpfs -o mode=1777 tmpfs {root}/tmp
            mkdir -p {root}{RELEASE}
            mount --bind {release} {root}{RELEASE}
            mount -o remount,bind,ro {root}{RELEASE}
            install -m 0755 {STUB} {root}/usr/local/sbin/systemctl
            echo ready
            exec chroot {root} sleep {HOLD_S}
        """
        self.holder = subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation",
                                        "private", "sh", "-euc", boot], stdout=subprocess.PIPE, text=True)
        line = self.holder.stdout.readline()
        assert line.strip() == "ready", f"host {namespace} did not boot (exit {self.holder.poll()})"

    def command(self, script: str, env: dict[str, str]) -> list[str]:
        """`script` by sh as root on this host, in the release, with a login's bare environment."""
        variables = [f"{k}={v}" for k, v in {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", **env}.items()]
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "-r", "-w", "--", "env", "-i", *variables,
                "sh", "-euxc", f"cd {RELEASE}\n{script}"]

    def run(self, script: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(script, env), capture_output=True, text=True, timeout=timeout)

    def start(self, script: str, **env: str) -> subprocess.Popen:
        """`script` in the background (its output kept for communicate())."""
        return subprocess.Popen(self.command(script, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(self, path: str) -> str:
        done = self.run(f"cat {path}")
        assert done.returncode == 0, done.stderr
        return done.stdout


def runbook_blocks() -> dict[str, str]:
    """docs/runbook.md's shell blocks, each marked `<!-- run: NAME -->` on the line before: NAME -> its text."""
    found = re.findall(r"<!-- run: ([\w-]+) -->\n *```sh\n(.*?\n) *```", RUNBOOK.read_text(), re.S)
    return {name: textwrap.dedent(text) for name, text in found}
