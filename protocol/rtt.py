"""A round-trip estimate for retransmission timeouts (RFC 6298: srtt + 4 rttvar). Pure.

Fed only with the times of things sent once (Karn: the answer to a thing
sent twice could be to either). Used by the client for its resends and by
listeners for their gap requests: a fixed timeout below what a loaded
cluster takes to answer sends everything again, which loads it further."""

from __future__ import annotations


class RoundTrip:
    def __init__(self, floor_ns: int, cap_ns: int):
        self.floor_ns = floor_ns  # the least timeout (the configured one)
        self.cap_ns = cap_ns
        self.srtt_ns = 0  # smoothed round trip (0: no sample yet)
        self.rttvar_ns = 0  # its mean deviation

    def sample(self, took_ns: int) -> None:
        if self.srtt_ns == 0:
            self.srtt_ns, self.rttvar_ns = took_ns, took_ns // 2
            return
        self.rttvar_ns += (abs(self.srtt_ns - took_ns) - self.rttvar_ns) // 4
        self.srtt_ns += (took_ns - self.srtt_ns) // 8

    @property
    def timeout_ns(self) -> int:
        return min(max(self.floor_ns, self.srtt_ns + 4 * self.rttvar_ns), self.cap_ns)
