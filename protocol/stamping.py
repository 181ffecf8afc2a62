"""Stamping inbound messages straight into full downstream packets: the
sequencer's publish path. Every sequenced block is the same 77 bytes, so a
packet holds a fixed number of messages and is built with one join."""

from __future__ import annotations

from tape.protocol.messages import BLOCK_PREFIX, ENVELOPE, SEQUENCED_BLOCK_SIZE
from tape.protocol.moldudp64 import DEFAULT_MAX_PACKET, HEADER, HEADER_SIZE


def messages_per_packet(max_packet: int = DEFAULT_MAX_PACKET) -> int:
    n = (max_packet - HEADER_SIZE) // SEQUENCED_BLOCK_SIZE
    if n < 1:
        raise ValueError(f"max packet {max_packet} bytes holds no message")
    return min(n, 0xFFFE)


class PacketBuilder:
    """Numbers messages from `next_seq` and cuts them into packets of at most
    `max_packet` bytes."""

    def __init__(self, session: bytes, next_seq: int = 1, max_packet: int = DEFAULT_MAX_PACKET):
        self.session = session
        self.next_seq = next_seq
        self.per_packet = messages_per_packet(max_packet)

    def add_stamped(self, inbound: list, stamp_ns: int, origin: bytes, first_client_seq: int) -> list[bytes]:
        """Stamp consecutive inbound messages of one client and pack them."""
        env = ENVELOPE.pack
        return self.add_sequenced([msg + env(stamp_ns, origin, i) for i, msg in enumerate(inbound, first_client_seq)])

    def add_sequenced(self, sequenced: list) -> list[bytes]:
        """Pack already-sequenced 75-byte messages: a packet is its header and one join (the
        block prefix as the separator), no Python step per message."""
        out = []
        seq = self.next_seq
        for start in range(0, len(sequenced), self.per_packet):
            chunk = sequenced[start:start + self.per_packet]
            out.append(HEADER.pack(self.session, seq, len(chunk)) + BLOCK_PREFIX + BLOCK_PREFIX.join(chunk))
            seq += len(chunk)
        self.next_seq = seq
        return out
