"""The emitter's sinks and its bad-input handling (issue 4): a real HTTP
endpoint for the webhook, a real `tape emitter` process, and the test
speaking the alert link over real TCP as the replicas would."""

import base64
import errno
import http.server
import io
import json
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lmdb
import pytest
from compilers import where_built
from conftest import connect, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from tape.ops.verification.local import LocalCluster
from tape.protocol import alertlink
from tape.replicas import sinks
from tape.replicas.audit_core import Alert
from tape.replicas.emitter_node_core import keep_newest
from tape.replicas.emitter_shell import Emitter
from tape.replicas.sinks import JsonLinesSink, WebhookSink
from tape.runtime.config import default_toml, load
from tape.runtime.linkclient import LinkSocket


class Endpoint:
    """A webhook receiver: answers the first `fail` POSTs with `status`, then 200; records what it got."""

    def __init__(self, fail: int = 0, status: int = 503, location: str = ""):
        self.fail, self.status, self.location = fail, status, location
        self.posts: list[tuple[str, dict]] = []
        self.received: list[tuple[dict, bytes]] = []  # every POST's headers and body
        self.attempts = 0
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.received.append((dict(self.headers), body))
                endpoint.attempts += 1
                if endpoint.attempts <= endpoint.fail:
                    self.send_response(endpoint.status)
                    if endpoint.location:
                        self.send_header("Location", endpoint.location)
                else:
                    endpoint.posts.append((self.headers["Idempotency-Key"], json.loads(body)))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def alert_ids(endpoint: Endpoint) -> list[str]:
    """The alert ids of the keys an emitter process posted, each `<alert id>/<its origin>`: one
    origin, 16 hex digits (tests/test_emitter.py makes the one of another emitter differ)."""
    ids, origins = zip(*(key.rsplit("/", 1) for key, _ in endpoint.posts))
    assert len(set(origins)) == 1 and re.fullmatch(r"[0-9a-f]{16}", origins[0]), origins
    return list(ids)


@pytest.fixture
def endpoint():
    e = Endpoint(fail=2)
    yield e
    e.close()


def alert(seq: int, cumulative: int = 120) -> Alert:
    return Alert(seq, seq, 7000 + seq, 500 + seq, b"load0".ljust(16), b"ACME".ljust(8), 100, cumulative, seq * 10)


def record(seq: int) -> sinks.AlertLine:
    return sinks.alert_lines([alert(seq).encode()], "TAPE")[0]


@given(st.lists(st.binary(min_size=0, max_size=90), min_size=1, max_size=20), st.booleans())
def test_a_batch_of_alert_frames_is_each_alert_framed(records, one_size):
    """alertlink.alerts frames records of one size by one join, others one at a time: either way
    the bytes of framing each, read back as the records in order."""
    if one_size:
        records = [r.ljust(90, b"x") for r in records]
    framed = alertlink.alerts(records)
    assert framed == b"".join(map(alertlink.alert, records))
    assert alertlink.Reader().feed(framed) == [(alertlink.ALERT, r) for r in records]
    mixed = framed + alertlink.digest(7, bytes(16)) + framed  # the emitter reads runs of one kind
    assert alertlink.Reader().runs(mixed) == [(alertlink.ALERT, records),
                                              (alertlink.DIGEST, [alertlink.FOLD.pack(7, bytes(16))]),
                                              (alertlink.ALERT, records)]


def test_webhook_retries_with_backoff_and_sends_the_idempotency_key(endpoint):
    sink = WebhookSink(endpoint.url, backoff_s=0.01)
    assert sink.deliver([record(1), record(2)]) == 2
    assert sink.retries == 2  # two 503s, then delivered
    assert [key for key, _ in endpoint.posts] == ["TAPE:1", "TAPE:2"]
    assert endpoint.posts[0][1]["order_id"] == 501


def test_webhook_refusal_is_counted_not_retried():
    e = Endpoint(fail=1, status=400)
    try:
        sink = WebhookSink(e.url, backoff_s=0.01)
        sink.deliver([record(1), record(2)])
        assert sink.refused == 1 and sink.retries == 0 and [k for k, _ in e.posts] == ["TAPE:2"]
    finally:
        e.close()


SECRET_PATH = "/hooks/T0KEN-in-the-path"


@pytest.mark.parametrize("status, reason", [(401, "unauthorized"), (403, "unauthorized"), (301, "redirect"),
                                            (308, "redirect")])
def test_webhook_credentials_refused_or_a_url_moved_are_held_retried_and_counted_never_dropped(status, reason,
                                                                                                 caplog):
    e = Endpoint(fail=3, status=status, location="https://elsewhere.example/new/S3CRET" if reason == "redirect" else "")
    try:
        sink = WebhookSink(e.url + SECRET_PATH + "?token=Q", backoff_s=0.01)
        with caplog.at_level("WARNING", logger="tape.emitter"):
            assert sink.deliver([record(1)]) == 1
        assert sink.config_errors == {"unauthorized": 0, "redirect": 0} | {reason: 3}
        assert sink.refused == 0 and [k for k, _ in e.posts] == ["TAPE:1"]  # held until it was taken
        said = caplog.text
        assert ("check webhook_authorization" in said if reason == "unauthorized" else
                "moved to https://elsewhere.example/…; set it there" in said), said
        assert "T0KEN" not in said and "token=Q" not in said and "S3CRET" not in said
        assert f"webhook {e.url.removesuffix('/alerts')}/…: alert TAPE:1 not delivered" in said
    finally:
        e.close()


def test_a_webhook_post_carries_its_authorization_and_a_standard_webhooks_signature_that_verifies():
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    secret = "whsec_" + base64.b64encode(bytes(range(32))).decode()
    e = Endpoint()
    try:
        sink = WebhookSink(e.url, authorization="Bearer abc", secret=bytes(range(32)))
        sink.deliver([record(1), record(2)])
        (headers, body), _ = e.received
        assert headers["Authorization"] == "Bearer abc" and headers["webhook-id"] == "TAPE:1"
        lower = {k.lower(): v for k, v in headers.items()}
        assert Webhook(secret).verify(body, lower)["order_id"] == 501  # the library, not our code, says it is ours
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(body.replace(b"501", b"502"), lower)
    finally:
        e.close()


def test_webhook_gives_up_only_when_stopping():
    stopping = threading.Event()
    sink = WebhookSink("http://127.0.0.1:9/none", timeout_s=0.2, backoff_s=0.01, stopping=stopping)
    threading.Timer(0.3, stopping.set).start()
    with pytest.raises(Exception, match="TAPE:1"):
        sink.deliver([record(1)])
    assert sink.retries >= 2


def test_jsonl_sink_remembers_the_newest_ids_within_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(sinks, "IDS_KEPT", 5)
    sink = JsonLinesSink(tmp_path / "alerts.jsonl")
    for first in range(1, 30, 4):
        sink.deliver([record(seq) for seq in range(first, first + 4)])
        assert len(sink.recent) <= 5
    assert list(sink.recent) == [f"TAPE:{seq}" for seq in range(28, 33)]
    assert sink.deliver([record(32), record(33)]) == 1  # the newest still never twice
    sink.close()


def test_jsonl_sink_cuts_a_torn_line_and_never_writes_an_id_twice(tmp_path):
    path = tmp_path / "alerts.jsonl"
    sink = JsonLinesSink(path)
    assert sink.deliver([record(1), record(2)]) == 2
    sink.close()
    with open(path, "a") as f:
        f.write('{"alert_id":"TAPE:3","emit')  # torn by a crash
    sink = JsonLinesSink(path)
    assert sink.deliver([record(2), record(3)]) == 1
    sink.close()
    assert [json.loads(line)["alert_id"] for line in path.read_text().splitlines()] == ["TAPE:1", "TAPE:2", "TAPE:3"]


REAL_FDATASYNC = os.fdatasync


def written_ids(path: Path) -> list[str]:
    return [json.loads(line)["alert_id"] for line in path.read_text().splitlines()]


def counted_fdatasync(monkeypatch) -> list[int]:
    """The descriptors fdatasync is called on from now on (each call still made)."""
    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), REAL_FDATASYNC(fd))[1])
    return calls


def refuse_fdatasync(fd: int) -> None:
    raise OSError(errno.EIO, "Input/output error")  # a failing disk (none can fail here for real)


def test_jsonl_sink_syncs_each_batch_or_when_asked_and_a_refused_sync_cuts_back_to_the_last(tmp_path, monkeypatch):
    """Each batch durable before delivered returns (the default), or only when `sync` is called; a
    sync the disk refuses cuts the file back to what the last one made durable and forgets those
    ids, so that they are written again when they come again."""
    path = tmp_path / "alerts.jsonl"
    calls = counted_fdatasync(monkeypatch)
    sink = JsonLinesSink(path)
    assert sink.try_deliver([record(1)]) and len(calls) == 1
    sink.sync_each_batch = False
    assert sink.try_deliver([record(2)]) and sink.try_deliver([record(3)]) and len(calls) == 1
    sink.sync()
    sink.sync()  # nothing new: no call
    assert len(calls) == 2
    assert sink.try_deliver([record(4), record(5)])
    monkeypatch.setattr(os, "fdatasync", refuse_fdatasync)
    with pytest.raises(OSError):
        sink.sync()
    assert written_ids(path) == ["TAPE:1", "TAPE:2", "TAPE:3"]
    calls = counted_fdatasync(monkeypatch)
    assert sink.deliver([record(3), record(4), record(5)]) == 2  # the forgotten ones again, the durable not
    sink.close()  # syncs what is left
    assert len(calls) == 1 and written_ids(path) == [f"TAPE:{seq}" for seq in range(1, 6)]


async def test_a_record_of_delivered_alerts_syncs_the_file_first_and_fails_with_it(tmp_path, monkeypatch):
    """Every sink idempotent: the file is synced once a record, just before it, not once a batch;
    a refused sync fails the record (the mark stays where it was recorded), and the alerts, sent
    again from that mark, are in the file once each."""
    cluster = LocalCluster(tmp_path, replicas=3)
    emitter = Emitter(cluster.cfg, cluster.cfg.node("emitter"))
    path = emitter.sinks[0].path
    assert emitter.core.deliver_first and emitter.sinks[0].sync_each_batch is False
    calls = counted_fdatasync(monkeypatch)
    await emitter._carry_out(emitter.core.deliver([alert(1).encode()]))
    await emitter._carry_out(emitter.core.deliver([alert(2).encode(), alert(3).encode()]))
    assert written_ids(path) == ["TAPE:1", "TAPE:2", "TAPE:3"] and calls == []
    monkeypatch.setattr(os, "fdatasync", refuse_fdatasync)
    await emitter._carry_out(emitter.core.done_due())
    assert emitter.record_failures == 1
    assert emitter.core.mark == emitter.core.recorded == 0 and written_ids(path) == []
    calls = counted_fdatasync(monkeypatch)
    await emitter._carry_out(emitter.core.deliver([alert(seq).encode() for seq in (1, 2, 3)]))
    await emitter._carry_out(emitter.core.done_due())
    assert emitter.core.recorded == 3 and written_ids(path) == ["TAPE:1", "TAPE:2", "TAPE:3"]
    assert calls[0] == emitter.sinks[0]._fd  # the file, before LMDB's own sync
    emitter._timer.cancel()
    for sink in emitter.sinks:
        sink.close()
    emitter.env.close()


async def test_the_file_is_written_on_the_emitters_thread_and_each_batch_reaches_each_sink_once(tmp_path, monkeypatch):
    """The JSON-lines file is tried on the emitter's own thread (no hand-off); the webhook and
    stdout, and a file whose write the disk refused, get the batch on a worker thread, where the
    file retries: every sink has every batch exactly once, in order."""
    on_main = threading.main_thread

    class Out(io.StringIO):
        threads: list[bool] = []

        def write(self, text: str) -> int:
            self.threads.append(threading.current_thread() is on_main())
            return super().write(text)

    jsonl, out = JsonLinesSink(tmp_path / "alerts.jsonl"), Out()
    written_on_main = []
    real_append = jsonl._append
    refusals = iter([True, False])  # the disk takes the first batch, refuses the next write once

    def append(data: bytes) -> bool:
        written_on_main.append(threading.current_thread() is on_main())
        return next(refusals, True) and real_append(data)

    monkeypatch.setattr(jsonl, "_append", append)
    webhook = WebhookSink("http://127.0.0.1:9/")
    posted = []
    monkeypatch.setattr(webhook, "deliver", lambda records: posted.append(
        (threading.current_thread() is on_main(), [r.alert_id for r in records])))
    emitter = SimpleNamespace(sinks=[jsonl, sinks.StdoutSink(out), webhook])
    await Emitter._deliver(emitter, [record(1), record(2)])
    await Emitter._deliver(emitter, [record(3)])
    jsonl.close()
    written = [json.loads(line)["alert_id"] for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert written == ["TAPE:1", "TAPE:2", "TAPE:3"]
    assert written_on_main == [True, True, False]  # tried here twice; the refused one again on a worker
    assert [json.loads(line)["alert_id"] for line in out.getvalue().splitlines()] == written
    assert out.threads == [False, False] and posted == [(False, ["TAPE:1", "TAPE:2"]), (False, ["TAPE:3"])]


# --- a real emitter process ----------------------------------------------------------------


WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"the emitter's webhook signing key").decode()


def emitter_cluster(tmp_path: Path, url: str) -> LocalCluster:
    cluster = LocalCluster(tmp_path, replicas=3)
    text = cluster.config_path.read_text().replace(
        'role = "emitter"', f'role = "emitter"\nsinks = ["jsonl", "webhook", "stdout"]\nwebhook_url = "{url}"\n'
        f'webhook_authorization = "Bearer xyz"\nwebhook_secret = "{WEBHOOK_SECRET}"')
    cluster.config_path.write_text(text)
    cluster.cfg = load(cluster.config_path)
    return cluster


def link(cluster: LocalCluster, hello: bytes, keys=True, replica: str = "") -> LinkSocket:
    """An alert link in `replica`'s name (by default the one `hello` names), with its pair key with
    the emitter or none. The emitter opens its alert port only after resolving what was in doubt
    (its metrics come up first): poll for it, with a deadline."""
    emitter = cluster.cfg.node("emitter")
    sock = connect(emitter.alert_port, "the emitter's alert port")
    own = cluster.cfg.links_of(cluster.cfg.node(replica or hello.decode().strip()))
    sock = LinkSocket(sock, own if keys else None, emitter.wire_name)
    sock.sendall(alertlink.hello(hello))
    return sock


def frames(sock: LinkSocket, want: int) -> list:
    reader, got = alertlink.Reader(), []
    deadline = time.monotonic() + 10
    while len(got) < want and time.monotonic() < deadline:
        data = sock.recv(4096)
        if not data:
            break
        got += reader.feed(data)
    return got


def closed_by_peer(sock: LinkSocket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def emitter_metric(cluster: LocalCluster, name: str) -> float:
    return cluster.metrics("emitter")[f'tape_emitter_{name}{{node="emitter"}}']


def rejected(cluster: LocalCluster, reason: str) -> float:
    return cluster.metrics("emitter").get(f'tape_emitter_rejected_total{{node="emitter",reason="{reason}"}}', 0)


@pytest.mark.process
def test_emitter_refuses_bad_input_and_delivers_to_every_sink_once(tmp_path, endpoint):
    cluster = emitter_cluster(tmp_path, endpoint.url)
    try:
        cluster.start_node("emitter")
        keyless = link(cluster, b"replica-A ", keys=False)  # a replica's name, without the cluster key
        assert closed_by_peer(keyless)  # nothing answered (it wants a link hello first), closed after the timeout
        assert cluster.metrics("emitter")['tape_emitter_link_refused_total{node="emitter",reason="hello_timeout"}'] == 1
        stranger = link(cluster, b"mallory".ljust(10), replica="replica-A")
        assert closed_by_peer(stranger)
        impostor = link(cluster, b"replica-B ", replica="replica-A")  # A's key, B's name
        assert closed_by_peer(impostor)
        assert rejected(cluster, "not_the_peer") == 2  # the hello must name the node the handshake proved
        a = link(cluster, b"replica-A ")
        assert frames(a, 1)[0] == (alertlink.WELCOME, alertlink.MARK.pack(0))
        a.sendall(alertlink.alert(b"\x01\x02\x03"))  # well framed, not an alert
        assert closed_by_peer(a)
        assert rejected(cluster, "malformed_alert") == 1
        junk = link(cluster, b"replica-A ")
        frames(junk, 1)
        junk.sendall(b"\x00\x00\x00\x05Zjunk")  # unknown frame type
        assert closed_by_peer(junk)
        assert rejected(cluster, "bad_frame") == 1
        again = link(cluster, b"replica-A ")
        frames(again, 1)
        again.sendall(alertlink.alert(alert(1).encode()) + alertlink.hello(b"replica-A "))  # a second hello
        assert closed_by_peer(again)
        assert rejected(cluster, "unexpected_frame") == 1

        a = link(cluster, b"replica-A ")
        frames(a, 1)
        a.sendall(b"".join(alertlink.alert(alert(s).encode()) for s in (11, 12, 13)))
        assert (alertlink.ACK, alertlink.MARK.pack(13)) in frames(a, 1)
        b = link(cluster, b"replica-B ")
        assert frames(b, 1)[0] == (alertlink.WELCOME, alertlink.MARK.pack(13))
        b.sendall(alertlink.alert(alert(12).encode()) + alertlink.alert(alert(13, cumulative=999).encode()))
        # (B was welcomed with the mark that covers its copies: no ack follows them)
        m = wait_for(lambda: (m := cluster.metrics("emitter"))['tape_emitter_divergences_total{node="emitter"}'] and m,
                     "B's copies judged")
        assert m['tape_emitter_duplicates_total{node="emitter"}'] == 1
        # A's three alerts came in one write: one delivery (one intent, one write to each sink)
        assert m['tape_emitter_alerts_delivered_total{node="emitter"}'] == 3
        assert m['tape_emitter_delivery_batches_total{node="emitter"}'] == 1
        assert m['tape_emitter_divergences_total{node="emitter"}'] == 1
        assert m['tape_emitter_sink_retries_total{node="emitter",sink="webhook"}'] == 2
        assert m['tape_emitter_webhook_config_errors_total{node="emitter",reason="unauthorized"}'] == 0
        for s in (keyless, stranger, a, b):
            s.close()
        cluster.stop("emitter")
        want = ["TAPE:11", "TAPE:12", "TAPE:13"]
        assert alert_ids(endpoint) == want
        from standardwebhooks.webhooks import Webhook

        for headers, body in endpoint.received:  # the config's secret and header, on every POST
            assert headers["Authorization"] == "Bearer xyz"
            Webhook(WEBHOOK_SECRET).verify(body, {k.lower(): v for k, v in headers.items()})
        stdout = cluster.output("emitter").splitlines()
        assert [json.loads(line)["alert_id"] for line in stdout] == want
        sink = Path(cluster.cfg.node("emitter").data) / "alerts.jsonl"
        assert [json.loads(line)["alert_id"] for line in sink.read_text().splitlines()] == want
        assert "DIVERGENCE" in cluster.logs["emitter"].read_text()
    finally:
        cluster.close()


@pytest.mark.process
def test_emitter_crash_resends_in_doubt_alerts_to_the_webhook_and_lists_them_for_stdout(tmp_path, endpoint):
    endpoint.fail = 0
    cluster = emitter_cluster(tmp_path, endpoint.url)
    try:
        proc = cluster.start_node("emitter", 0.0, 0, "--crash-at", "after_deliver")
        a = link(cluster, b"replica-A ")
        frames(a, 1)
        a.sendall(alertlink.alert(alert(21).encode()))
        assert proc.wait(timeout=20) == 99
        a.close()
        cluster.start_node("emitter")
        a = link(cluster, b"replica-A ")
        assert frames(a, 1)[0] == (alertlink.WELCOME, alertlink.MARK.pack(21))
        a.sendall(alertlink.alert(alert(21).encode()) + alertlink.alert(alert(22).encode()))
        assert (alertlink.ACK, alertlink.MARK.pack(22)) in frames(a, 1)
        a.close()
        cluster.stop("emitter")
        # The webhook saw 21 twice under the same key (its receiver drops the copy), then 22: the origin
        # the emitter made at its first start, kept across the crash.
        assert alert_ids(endpoint) == ["TAPE:21", "TAPE:21", "TAPE:22"]
        data = Path(cluster.cfg.node("emitter").data)
        assert [json.loads(line)["alert_id"] for line in (data / "alerts.jsonl").read_text().splitlines()] == \
            ["TAPE:21", "TAPE:22"]
        listed = [json.loads(line) for line in (data / "in_doubt.jsonl").read_text().splitlines()]
        assert [(r["alert_id"], r["sink"]) for r in listed] == [("TAPE:21", "stdout")]
    finally:
        cluster.close()


@pytest.mark.process
@pytest.mark.parametrize("delivery", ["first", "quorum"])
def test_a_compromised_replica_forges_an_alert_only_under_first_delivery(tmp_path, delivery):
    """replica-A holds the cluster key but lies: it sends a changed alert 31 and a made-up 32 first.
    Under `first` they are delivered; under `quorum` B and C outvote the change, 32 reaches no
    quorum once both went past it, and only the true alerts are delivered, in order."""
    cluster = LocalCluster(tmp_path, replicas=3, delivery=delivery)
    try:
        cluster.start_node("emitter")
        a, b, c = (link(cluster, f"replica-{r}".encode().ljust(10)) for r in "ABC")
        for s in (a, b, c):
            frames(s, 1)  # welcome
        a.sendall(b"".join(alertlink.alert(x.encode()) for x in (alert(31, cumulative=999), alert(32), alert(33))))
        taken = "alerts_delivered_total" if delivery == "first" else "pending"  # (A's batch handled before the others)
        wait_for(lambda: emitter_metric(cluster, taken) == 3, f"A's alerts {taken}")
        for s in (b, c):
            s.sendall(b"".join(alertlink.alert(alert(n).encode()) for n in (31, 33)))
        settled = "duplicates_total" if delivery == "first" else "alerts_delivered_total"  # (31 and 33, each side)
        wait_for(lambda: (emitter_metric(cluster, "divergences_total"), emitter_metric(cluster, settled)) == (2, 2),
                 "B's and C's copies judged")
        for s in (a, b, c):
            s.close()
        cluster.stop("emitter")
        sink = Path(cluster.cfg.node("emitter").data) / "alerts.jsonl"
        got = [(r["emit_seq"], r["cumulative"]) for r in map(json.loads, sink.read_text().splitlines())]
        status = json.loads((Path(cluster.cfg.node("emitter").data) / "status.json").read_text())
        if delivery == "first":
            assert got == [(31, 999), (32, 120), (33, 120)]
        else:
            assert got == [(31, 120), (33, 120)] and status["divergences"] == 2
            assert "reached no quorum" in cluster.logs["emitter"].read_text()
    finally:
        cluster.close()


def test_the_emitter_keeps_the_newest_recorded_alerts_within_its_limit():
    """At least the newest `limit`, at most an eighth more (forgotten in bulk), always the newest."""
    recent: dict[bytes, bytes] = {}
    for first in range(1, 1000, 7):
        keep_newest(recent, [seq.to_bytes(8, "big") + b"%d" % seq for seq in range(first, first + 7)], 64)
        kept = [int.from_bytes(k, "big") for k in recent]
        assert kept == list(range(first + 7 - len(kept), first + 7))  # the newest, in order
        assert min(64, first + 6) <= len(kept) <= 64 + 8
    assert recent[(1000).to_bytes(8, "big")].endswith(b"1000")


def outbox(cluster: LocalCluster) -> list[int]:
    """The emit seqs in the emitter's outbox (intent recorded, done not), read beside the process."""
    env = lmdb.open(str(Path(cluster.cfg.node("emitter").data) / "lmdb"), max_dbs=4, readonly=True)
    try:
        with env.begin() as txn:
            return [int.from_bytes(k, "big") for k, _ in txn.cursor(db=env.open_db(b"outbox", txn=txn))]
    finally:
        env.close()


def acked(sock: LinkSocket, mark: int) -> bool:
    """An acknowledgement of `mark` comes within 10 s (others before it are read past)."""
    reader, deadline = alertlink.Reader(), time.monotonic() + 10
    while time.monotonic() < deadline:
        data = sock.recv(4096)
        if not data:
            return False
        if (alertlink.ACK, alertlink.MARK.pack(mark)) in reader.feed(data):
            return True
    return False


@pytest.mark.process
@pytest.mark.parametrize("sinks", ["jsonl", "jsonl,stdout"])
def test_a_batch_is_recorded_soon_when_no_next_batch_comes_and_at_a_clean_stop(tmp_path, sinks):
    """Every sink idempotent: what was delivered is recorded soon after (and only then acknowledged).
    With stdout: a batch's done rides in the next batch's intent; without one it is recorded alone
    soon after. Either way before a clean stop too: nothing is left in doubt for the next start."""
    cluster = LocalCluster(tmp_path, replicas=3)
    try:
        cluster.start_node("emitter", 0.0, 0, "--sinks", sinks)
        a = link(cluster, b"replica-A ")
        frames(a, 1)
        a.sendall(alertlink.alert(alert(41).encode()))
        assert acked(a, 41)
        wait_for(lambda: outbox(cluster) == [], "the idle batch's done", timeout=5)
        a.sendall(alertlink.alert(alert(42).encode()) + alertlink.alert(alert(43).encode()))
        assert acked(a, 43)
        a.close()
        assert cluster.stop("emitter") == 0
        assert outbox(cluster) == []
        cluster.start_node("emitter")
        frames(link(cluster, b"replica-A "), 1)  # up: what was in doubt is resolved before the port opens
        log = cluster.logs["emitter"].read_text()
        assert "in doubt" not in log and re.findall(r"emitter at mark (\d+)", log)[-1] == "43"
    finally:
        cluster.close()


BATCHES_KEEP_COMING = 2000  # at one each 5 ms or more: 10 s at least, RECORD_AFTER_NS 500 times over


@pytest.mark.process
def test_batches_that_keep_coming_do_not_put_off_their_record(tmp_path):
    """Every sink idempotent: what was delivered is recorded at most RECORD_AFTER_NS after the first
    batch not yet recorded, however often batches follow it (a timer put off by each one would
    record nothing, and acknowledge nothing, while a replica keeps sending)."""
    cluster = LocalCluster(tmp_path, replicas=3)
    try:
        cluster.start_node("emitter", 0.0, 0, "--sinks", "jsonl")
        a = link(cluster, b"replica-A ")
        frames(a, 1)
        a.settimeout(0.005)
        reader, marks = alertlink.Reader(), [0]
        for seq in range(1, BATCHES_KEEP_COMING + 1):  # a batch every 5 ms or more (bounded by count, not time)
            a.sendall(alertlink.alert(alert(seq).encode()))
            try:  # (acknowledgements of the mark recorded so far, 0 until a record; waits 5 ms)
                marks += [alertlink.MARK.unpack(p)[0] for k, p in reader.feed(a.recv(4096)) if k == alertlink.ACK]
            except TimeoutError:
                pass
            if any(marks):
                break
        assert any(marks), f"no record acknowledged while {seq} batches kept coming"
        a.close()
    finally:
        cluster.close()


U64, I64 = st.integers(0, 2**64 - 1), st.integers(-2**63, 2**63 - 1)


@settings(max_examples=300)
@given(st.text(max_size=12), U64, U64, U64, U64, st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8),
       I64, I64, I64)
def test_an_alert_line_is_what_json_dumps_writes(session, emit, pseq, pid, oid, client, stock, req, cum, stamp):
    """Sinks write an alert's line straight from its record's bytes (sinks.alert_lines): byte for byte
    json.dumps's line of its record as a dict, for any field values and session name, next to others."""
    records = [Alert(emit, pseq, pid, oid, client, stock, req, cum, stamp).encode(), alert(3).encode()]
    for raw, got in zip(records, sinks.alert_lines(records, session), strict=True):
        as_dict = Alert.decode(raw).to_dict(session)
        assert got == (as_dict["alert_id"], json.dumps(as_dict, separators=(",", ":")))


FIELD_BYTES = b' \t\n\x0b\x0c\r\x1c\x1f\x7f\x80\xff"\\aZ'  # what rstrip strips, json escapes, ascii refuses
CLIENT_AND_STOCK = (st.binary(min_size=24, max_size=24)
                    | st.lists(st.sampled_from(FIELD_BYTES), min_size=24, max_size=24).map(bytes))


@where_built
def test_the_c_alert_lines_were_built_where_a_compiler_exists():
    assert sinks._alert_lines_c is not None


@pytest.mark.skipif(sinks._alert_lines_c is None, reason="built without a C compiler")
@settings(max_examples=400)
@given(st.text(st.characters(max_codepoint=127), max_size=12),
       st.lists(st.tuples(U64, U64, CLIENT_AND_STOCK, I64), max_size=5))
def test_c_and_pure_alert_lines_are_the_same(session, fields):
    """The C lines (any ASCII session) are alert_lines_pure's, for client and stock bytes of every kind:
    whitespace that str.rstrip strips (or not, inside), control bytes, quotes, backslashes, bytes above
    127; and each is an AlertLine."""
    records = [Alert(emit, pseq, emit ^ pseq, pseq >> 1, field[:16], field[16:], stamp, -stamp - 1, stamp).encode()
               for emit, pseq, field, stamp in fields]
    got = sinks.alert_lines(records, session)
    assert got == sinks.alert_lines_pure(records, session)
    assert all(type(line) is sinks.AlertLine for line in got)


def test_a_stop_during_a_sinks_back_off_ends_it_with_no_attempt_after(tmp_path):
    """The emitter stopping while a sink waits to try again: SinkStopped at once, and the attempt
    that would have followed the wait (a webhook's POST, up to its timeout) is not made."""

    stopping, attempts = threading.Event(), []

    def attempt() -> bool:
        attempts.append(1)
        threading.Timer(0.05, stopping.set).start()  # the stop comes during the wait that follows
        return False

    outcome = []

    def back_off():  # waits of an hour: ended by the stop or never (the test's deadline)
        try:
            sinks.until_done(attempt, stopping, 3600.0, 3600.0, lambda delay: None, "TAPE:1")
        except sinks.SinkStopped as e:
            outcome.append(str(e))

    threading.Thread(target=back_off, daemon=True).start()
    wait_for(lambda: outcome, "the stop to end the back-off", timeout=60)
    assert "TAPE:1" in outcome[0] and attempts == [1]


def test_an_emitters_origin_is_made_at_its_first_start_and_kept_and_another_emitters_differs(tmp_path):
    """The webhook's Idempotency-Key is `<alert id>/<origin>`: the same across the emitter's
    restarts (a resent alert is dropped by the receiver), another for another emitter (two clusters
    of one session name posting to one receiver never share a key)."""
    path = tmp_path / "cluster.toml"
    path.write_text(default_toml(tmp_path / "data", replicas=1, free=True).replace(
        'role = "emitter"', 'role = "emitter"\nsinks = ["webhook"]\nwebhook_url = "http://127.0.0.1:9/"'))
    cfg = load(path)

    def origin(data: Path) -> str:
        node = cfg.node("emitter")
        node.data = str(data)
        emitter = Emitter(cfg, node)
        try:
            return emitter.sinks[0].headers(record(7), b"{}")["Idempotency-Key"]
        finally:
            emitter.env.close()

    first = origin(tmp_path / "one")
    assert re.fullmatch(r"TAPE:7/[0-9a-f]{16}", first) and origin(tmp_path / "one") == first
    assert origin(tmp_path / "two") != first
