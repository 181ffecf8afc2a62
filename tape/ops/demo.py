"""`tape demo`: the end-to-end path that exists today, on loopback multicast.

A publisher stamps generated trades, journals them (group commit) and
multicasts them as MoldUDP64 packets; a listener joins the group, drops a
seeded share of datagrams if asked, puts the stream back in order and fills
gaps by MoldUDP64 request packets to a gap-fill responder that serves from
the journal. At the end the listener's messages are checked against the
journal, message by message, and the journal's head is dumped.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import random
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tape.gctune import tune_gc
from tape.journal.store import Journal
from tape.ops.journal_tool import dump
from tape.ops.tradegen import TradeGenerator
from tape.protocol import messages, moldudp64
from tape.protocol.errors import ProtocolError
from tape.protocol.packets import PacketBuilder, messages_per_packet
from tape.protocol.receiver import StreamReceiver
from tape.rewinder.gapfill import GapFillCore
from tape.transport import LossInjector, free_port, multicast_receiver, multicast_sender, udp_socket

SESSION = moldudp64.session_bytes("DEMO")
ORIGIN = moldudp64.session_bytes("demo")
BATCH = 1000  # inbound messages per stamp/journal/publish batch


def run_demo(n: int, out: str | None, drop: float, seed: int) -> int:
    console = Console()
    tune_gc()
    workdir = Path(out) if out else Path(tempfile.mkdtemp(prefix="tape-demo-"))
    jdir = workdir / "journal"
    if jdir.exists():
        shutil.rmtree(jdir)
    group = f"239.{random.Random().randrange(1, 255)}.{random.Random().randrange(1, 255)}.7"
    port = free_port()
    result = asyncio.run(_run(console, n, jdir, group, port, drop, seed))
    _report(console, result, jdir, group, port)
    buf = io.StringIO()
    dump(str(jdir), 1, 3, "jsonl", buf)
    console.print("\n[bold]tape journal dump[/bold] " + str(jdir) + " --to 3")
    console.print(buf.getvalue().rstrip(), markup=False, highlight=False, soft_wrap=True)
    if not out:
        shutil.rmtree(workdir)
    return 0 if result["ok"] else 1


async def _run(console, n, jdir, group, port, drop, seed) -> dict:
    loop = asyncio.get_running_loop()
    journal = Journal(jdir, SESSION, fsync="batch")
    listen_sock, granted = multicast_receiver(group, port)
    send_sock = multicast_sender()
    fill_sock, _ = udp_socket()
    fill_addr = fill_sock.getsockname()
    req_sock, _ = udp_socket()
    fill_core = GapFillCore(SESSION, messages_per_packet())
    receiver = StreamReceiver(SESSION)
    loss = LossInjector(drop, seed)
    digest_rx = hashlib.blake2b(digest_size=16)
    done = asyncio.Event()
    stats = {"requests": 0, "bad": 0, "recv_bytes": granted}

    async def publish(progress, task):
        gen = TradeGenerator(seed)
        builder = PacketBuilder(SESSION, 1)
        sent = 0
        while sent < n:
            batch = gen.take(min(BATCH, n - sent))
            first = builder.next_seq
            packets = builder.add_stamped(batch, time.time_ns(), ORIGIN, first)
            journal.append(_records(packets, first))
            for pkt in packets:
                await loop.sock_sendto(send_sock, pkt, (group, port))
            sent += len(batch)
            progress.update(task, completed=sent)
            await asyncio.sleep(0)
        while not done.is_set():  # heartbeats carry the next seq: the tail gap shows
            await loop.sock_sendto(send_sock, moldudp64.encode_heartbeat(SESSION, builder.next_seq), (group, port))
            try:
                await asyncio.wait_for(done.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        await loop.sock_sendto(send_sock, moldudp64.encode_end_of_session(SESSION, builder.next_seq), (group, port))

    async def serve_gaps():
        while True:
            data, addr = await loop.sock_recvfrom(fill_sock, 2048)
            action = fill_core.on_request(data, addr, time.monotonic(), journal.last_seq)
            if isinstance(action, str):
                continue
            seq, count = action
            msgs = [m for _, _, m in journal.read_batch(seq, count)]
            for pkt in PacketBuilder(SESSION, seq).add_sequenced(msgs):
                await loop.sock_sendto(fill_sock, pkt, addr)

    async def listen():
        last_ask = (0, 0.0)
        while receiver.next_seq <= n:
            try:
                data = await asyncio.wait_for(loop.sock_recv(listen_sock, 65536), 0.02)
                from_mcast = True
            except asyncio.TimeoutError:
                data, from_mcast = None, False
            while True:  # retransmissions arrive on the request socket
                try:
                    reply = req_sock.recv(65536)
                except BlockingIOError:
                    break
                _accept(reply)
            if data is not None and not (from_mcast and loss.drop()):
                _accept(data)
            gap = receiver.missing()
            if gap and (gap[0] != last_ask[0] or time.monotonic() - last_ask[1] > 0.02):
                stats["requests"] += 1
                req_sock.sendto(moldudp64.encode_request(SESSION, gap[0], gap[1]), fill_addr)
                last_ask = (gap[0], time.monotonic())
        done.set()

    def _accept(data):
        try:
            session, seq, count = moldudp64.decode_header(data)
            if 0 < count < 0xFFFF:
                messages.check_packet_messages(data, count)
            for first, pkt, skip in receiver.on_packet(session, seq, count, data):
                for i in range(skip, moldudp64.HEADER.unpack_from(pkt)[2]):
                    digest_rx.update(messages.packet_message_bytes(pkt, i))
        except ProtocolError:
            stats["bad"] += 1

    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]publishing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("publish", total=n)
        server = asyncio.create_task(serve_gaps())
        await asyncio.gather(publish(progress, task), listen())
        server.cancel()
    elapsed = time.perf_counter() - t0
    journal.close()
    for s in (listen_sock, send_sock, fill_sock, req_sock):
        s.close()
    digest_journal = hashlib.blake2b(digest_size=16)
    j = Journal(jdir, readonly=True)
    count = 0
    for _, _, m in j.read():
        digest_journal.update(m)
        count += 1
    return {
        "messages": n, "journaled": count, "delivered": receiver.next_seq - 1, "elapsed": elapsed,
        "dropped": loss.dropped, "gaps": receiver.gaps_detected, "requests": stats["requests"],
        "served": fill_core.served, "duplicates": receiver.duplicates, "bad": stats["bad"],
        "rcvbuf": stats["recv_bytes"], "fsyncs": j.fsyncs,
        "identical": digest_rx.digest() == digest_journal.digest(),
        "ok": count == n and receiver.next_seq - 1 == n and digest_rx.digest() == digest_journal.digest(),
    }


def _records(packets: list[bytes], first: int) -> list:
    """Journal records for the messages of freshly built packets."""
    out = []
    seq = first
    for pkt in packets:
        count = moldudp64.HEADER.unpack_from(pkt)[2]
        for i in range(count):
            out.append((seq, 1, messages.packet_message_bytes(pkt, i)))
            seq += 1
    return out


def _report(console, r: dict, jdir, group, port) -> None:
    table = Table(title=f"tape demo: MoldUDP64 over loopback multicast {group}:{port}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("messages stamped and journaled", f"{r['journaled']:,}")
    table.add_row("messages delivered in order to the listener", f"{r['delivered']:,}")
    table.add_row("throughput (stamp, journal, publish, receive)", f"{r['messages'] / r['elapsed']:,.0f} msg/s")
    table.add_row("datagrams dropped by loss injection", f"{r['dropped']:,}")
    table.add_row("gaps detected / requests sent / answered", f"{r['gaps']:,} / {r['requests']:,} / {r['served']:,}")
    table.add_row("duplicate packets ignored", f"{r['duplicates']:,}")
    table.add_row("malformed datagrams dropped", f"{r['bad']:,}")
    table.add_row("receive buffer granted", f"{r['rcvbuf'] / (1 << 20):.0f} MiB")
    table.add_row("listener's stream identical to the journal", "[green]yes[/green]" if r["identical"] else "[red]NO[/red]")
    table.add_row("verdict", "[bold green]PASS[/bold green]" if r["ok"] else "[bold red]FAIL[/bold red]")
    console.print(table)
