"""The `tape` streaming source over a rewinder's replay port, for Spark hosts that do not hold a
journal: offsets are sequence numbers, as over a journal (ops/spark/stream.py).

    spark.readStream.format("tape").option("config", "/etc/tape/tape.toml").option("rewinder", "rw-1").load()

The replay port serves committed messages only, inside an authenticated link: the source logs in
with the cluster's listener key from the config, as any listener does (docs/security.md), and its
sessions share the listeners' replay budget. Each trigger asks where the log is committed (a login
from "the newest on" is answered with the next seq, then logged out); each partition replays its
range of seqs and logs out. A message on the replay port carries no term: `term` is the term of a
`term_start` row and null in the others (a journal's rows have it).
"""

from __future__ import annotations

import socket
import time

from pyspark.sql.datasource import InputPartition

from tape.ops.spark.stream import PARTITION_RECORDS, SeqStreamReader
from tape.protocol.limits import REPLAY_CLIENT_HEARTBEAT_S

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0  # longer than a rewinder's heartbeat (1 s) by far: silence this long is a dead session
ARROW_ROWS = 50_000  # rows an Arrow batch


class ReplayRange(InputPartition):
    def __init__(self, host: str, port: int, keys: list[bytes] | None, lo: int, hi: int):
        super().__init__((host, port, lo, hi))
        self.host, self.port, self.keys, self.lo, self.hi = host, port, keys, lo, hi


class ReplayStreamReader(SeqStreamReader):
    def __init__(self, options):
        from tape.runtime import config

        super().__init__(options)
        if not options.get("config") or not options.get("rewinder"):
            raise ValueError('over a rewinder: option("config", FILE) and option("rewinder", NODE) are both needed')
        cfg = config.load(options["config"])
        node = cfg.node(options["rewinder"])
        if node.role != "rewinder":
            raise ValueError(f"{node.name} is a {node.role}, not a rewinder")
        self.host, self.port, self.keys = node.host, node.replay_port, list(cfg.listener_keys) or None

    def committed(self) -> int:
        with ReplaySession(self.host, self.port, self.keys, 0) as session:
            return session.first - 1

    def partitions(self, start: dict, end: dict) -> list[ReplayRange]:
        return [ReplayRange(self.host, self.port, self.keys, lo, min(end["seq"], lo + PARTITION_RECORDS - 1))
                for lo in range(start["seq"] + 1, end["seq"] + 1, PARTITION_RECORDS)]

    def read(self, partition: ReplayRange):
        import pyarrow as pa

        from tape.ops.spark.source import _arrow_schema, _batch
        from tape.protocol import journal_columns as columns
        from tape.protocol import messages as M

        schema, rows, seq = _arrow_schema(), [], partition.lo
        with ReplaySession(partition.host, partition.port, partition.keys, partition.lo) as session:
            for message in session.messages(partition.hi - partition.lo + 1):
                fields = M.SEQUENCED.unpack(message)
                term = fields[M.ORDER_ID] if fields[M.TYPE] == M.TERM_START else None
                rows.append((0, M.SEQUENCED_SIZE, seq, term, *fields))
                seq += 1
                if len(rows) == ARROW_ROWS:
                    yield _batch(pa, schema, columns.to_columns(rows), f"{partition.host}:{partition.port}")
                    rows = []
        if rows:
            yield _batch(pa, schema, columns.to_columns(rows), f"{partition.host}:{partition.port}")


class ReplaySession:
    """A replay login from `seq` (0: from the newest committed on), over the link as a listener:
    `first`, the seq the rewinder will send first; `messages(n)`, the next n."""

    def __init__(self, host: str, port: int, keys: list[bytes] | None, seq: int):
        from tape.protocol import soupbintcp as soup
        from tape.protocol.linkauth import LinkKeys
        from tape.runtime.linkclient import LinkSocket

        self.where = f"{host}:{port}"
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(READ_TIMEOUT_S)
        try:
            self.link = LinkSocket(sock, LinkKeys(keys) if keys else None)
            self.link.sendall(soup.login("", "", b"", seq))
            self.frames, self.ready, self.beat = soup.FrameDecoder(), [], time.monotonic()
            kind, payload = self._next()
        except BaseException:
            sock.close()
            raise
        if kind != soup.LOGIN_ACCEPTED:
            sock.close()
            said = "rejected" if kind == soup.LOGIN_REJECTED else f"answered {kind!r}"
            raise ConnectionError(f"replay at {self.where}: login {said}")
        self.first = soup.parse_login_accepted(payload)[1]

    def messages(self, count: int):
        from tape.protocol import soupbintcp as soup

        while count:
            kind, payload = self._next()
            if kind == soup.SEQUENCED:
                count -= 1
                yield payload
            elif kind == soup.END_OF_SESSION:
                raise ConnectionError(f"replay at {self.where}: the session ended {count} messages short")

    def _next(self) -> tuple[bytes, bytes]:
        from tape.protocol import soupbintcp as soup

        while not self.ready:
            if time.monotonic() - self.beat >= REPLAY_CLIENT_HEARTBEAT_S:  # (else the rewinder takes it for gone)
                self.beat = time.monotonic()
                self.link.sendall(soup.heartbeat(server=False))
            data = self.link.recv(1 << 16)
            if not data:
                raise ConnectionError(f"replay at {self.where}: closed by the rewinder")
            self.ready = self.frames.feed(data)
            self.ready.reverse()
        return self.ready.pop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        from tape.protocol import soupbintcp as soup

        try:
            self.link.sendall(soup.logout())
        except OSError:
            pass
        self.link.close()
