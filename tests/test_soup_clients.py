"""A standard SoupBinTCP client replays from a rewinder's soup_port over TLS, its login checked
against [replay.users] (issue 63). The client is written here from the SoupBinTCP 4.0
specification and shares no code with Tape: a packet is a big-endian u16 length (of what
follows), a one-byte type and its payload; alpha fields are left-justified and padded with
spaces on the right, numeric fields right-justified and padded with spaces on the left."""

import re
import socket
import ssl
import struct

import pytest
from conftest import wait_for

from tape.ops.verification.certs import make_certificates
from tape.ops.verification.local import LocalCluster
from tape.runtime.config import load
from tape.runtime.storage.journal_store import Journal
from tape.runtime.udp import free_port

pytestmark = pytest.mark.process


class SpecClient:
    """SoupBinTCP 4.0, client side: login, then read sequenced packets and heartbeat."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        self.sock.sendall(struct.pack(">H", 1 + len(payload)) + kind + payload)

    def login(self, username: str, password: str, session: str = "", seq: int = 1) -> None:
        self.send(b"L", username.ljust(6).encode() + password.ljust(10).encode() + session.ljust(10).encode()
                  + str(seq).rjust(20).encode())

    def packet(self) -> tuple[bytes, bytes]:
        while len(self.buf) < 2 or len(self.buf) < 2 + struct.unpack(">H", self.buf[:2])[0]:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the server")
            self.buf += data
        (length,) = struct.unpack(">H", self.buf[:2])
        packet, self.buf = self.buf[2:2 + length], self.buf[2 + length:]
        return packet[:1], packet[1:]


def with_soup_port(cluster: LocalCluster, node: str) -> int:
    """`node`'s [[node]] table given a soup_port: the config written again and reloaded."""
    port = free_port()
    text = cluster.config_path.read_text()
    at = text.index(f'name = "{node}"')
    head, tail = text[:at], text[at:]
    tail = re.sub(r"(replay_port = \d+)", rf"\1\nsoup_port = {port}", tail, count=1)
    cluster.config_path.write_text(head + tail)
    cluster.cfg = load(cluster.config_path)
    return port


def test_a_standard_soupbintcp_client_replays_over_tls_and_a_wrong_password_is_not_authorized(tmp_path):
    certs = tmp_path / "certs"
    make_certificates(certs, ["rw-1"], ip="127.0.0.1")
    replay = (f'[replay]\ncertfile = "{certs / "rw-1.pem"}"\nkeyfile = "{certs / "rw-1.key"}"\n'
              f'[replay.users]\nalice = "s3cret"\n')
    cluster = LocalCluster(tmp_path, extra=replay)
    port = with_soup_port(cluster, "rw-1")
    tls = ssl.create_default_context(cafile=certs / "ca.pem")
    try:
        cluster.start_all()
        load = cluster.start("load", "load", "--rate", "2000", "--messages", "3000", "--seed", "3")
        load.wait(timeout=60)
        committed = 'tape_rewinder_commit_seq{node="rw-1"}'
        wait_for(lambda: cluster.metrics("rw-1").get(committed, 0) >= 3000, "rw-1 to hold the load committed")
        n = int(cluster.metrics("rw-1")[committed])
        with tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                             server_hostname="127.0.0.1") as sock:
            client = SpecClient(sock)
            client.login("alice", "wrong")
            assert client.packet() == (b"J", b"A")  # not authorized
        with tls.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                             server_hostname="127.0.0.1") as sock:
            client = SpecClient(sock)
            client.login("alice", "s3cret", seq=1)
            kind, payload = client.packet()
            assert kind == b"A" and int(payload[10:30]) == 1  # accepted, from seq 1
            got = []
            while len(got) < n:
                kind, payload = client.packet()
                if kind == b"S":
                    got.append(payload)
                elif kind == b"H":
                    client.send(b"R")
            client.send(b"O")  # logout
        journal = Journal(cluster.journal_dir("rw-1"), readonly=True)
        assert got == [raw for _, _, raw in journal.read(1, n)]  # the log itself, in order
        with pytest.raises((ssl.SSLError, OSError)):  # the port speaks TLS only: plain bytes get nothing back
            with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
                SpecClient(plain).login("alice", "s3cret")
                SpecClient(plain).packet()
    finally:
        cluster.close()
