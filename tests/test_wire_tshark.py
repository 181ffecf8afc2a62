"""Wireshark's MoldUDP64 dissector (tshark) decodes the packets Tape sends
over loopback multicast: an independent decoder agrees with ours."""

import random
import shutil
import subprocess
import time

import pytest

from tape.protocol import messages as msg
from tape.protocol import moldudp64 as m
from tape.protocol.stamping import PacketBuilder
from tape.protocol.streamauth import StreamKeys
from tape.runtime.udp import free_port, multicast_sender
from tape.sequencer.leader_core import LeaderCore

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed (make test installs it)"),
]


def test_tshark_decodes_our_packets():
    port = free_port()
    group = f"239.{random.randrange(1, 255)}.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
    session = m.session_bytes("TAPE")
    inbound = [msg.purchase_request(i, 100, "Sendence", "AAPL") for i in range(1, 41)]
    packets = PacketBuilder(session, 1).add_stamped(inbound, time.time_ns(), m.session_bytes("client1"), 1)
    # Sealed packets (a stream key): the seal is a counted log entry, so they stay plain MoldUDP64.
    core = LeaderCore(session, m.session_bytes("seq-a"), 1, [], {m.session_bytes("client1"): None},
                      last_seq=40, stream_keys=StreamKeys([b"k" * 32]))
    core.on_inbound(m.encode_packet(m.session_bytes("client1"), 1, inbound), 0)
    packets += core.on_journaled(core.flush(time.time_ns(), time.time_ns()).last_seq)
    end = m.decode_packet(packets[-1]).seq + m.decode_packet(packets[-1]).count
    packets += [m.encode_heartbeat(session, end), m.encode_end_of_session(session, end)]
    cmd = ["tshark", "-i", "lo", "-l", "-f", f"udp port {port}", "-c", str(len(packets)), "-a", "duration:30",
           "-d", f"udp.port=={port},moldudp64", "-T", "fields", "-E", "occurrence=a", "-E", "aggregator=,",
           "-e", "moldudp64.session", "-e", "moldudp64.sequence", "-e", "moldudp64.count",
           "-e", "moldudp64.msglen", "-e", "_ws.expert.message"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "Capture started" in line or not line:
                break
        sock = multicast_sender()
        for pkt in packets:
            sock.sendto(pkt, (group, port))
            time.sleep(0.005)
        sock.close()
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = [line.split("\t") for line in out.splitlines() if line.strip()]
    assert len(rows) == len(packets), out
    expect_seq = 1
    for row, pkt in zip(rows, packets):
        sess, seq, count, lens, expert = (row + [""] * 5)[:5]
        ours = m.decode_packet(pkt)
        assert sess.rstrip() == "TAPE"
        assert int(seq) == ours.seq == expect_seq
        assert int(count) == ours.count
        if 0 < ours.count < 0xFFFF:
            assert lens.split(",") == ["75"] * ours.count
            expect_seq += ours.count
        assert "Invalid" not in expert
