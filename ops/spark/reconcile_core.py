"""The live audit's reconciliation: the alerts the stream implies against those the emitter
delivered, as both grow. Pure: alerts in, findings out.

    expect(alerts, through_seq)   alerts recomputed from the stream, which has been read through seq
    delivered(alerts)             alerts read from the emitter's file, in the order it wrote them
    findings()                    {finding: {"count", "first"}}, as far as either side has gone

An alert is judged only once both sides are past it: `missing` once the emitter has delivered a
later one (it delivers in emit-seq order), `unexpected` once the stream has been read past it;
`duplicate` and `mismatched` (the same alert id, another emit seq, purchase, order, request or
cumulative) at once. What is in neither judgement yet is pending, not a finding.
"""

from __future__ import annotations

FIELDS = ("emit_seq", "purchase_id", "order_id", "requested", "cumulative")
FINDINGS = ("missing", "duplicate", "unexpected", "mismatched")
SHOWN = 5  # ids shown of each finding


class Reconciliation:
    def __init__(self):
        self.expected: dict[str, tuple] = {}  # alert id -> FIELDS, every alert the stream implied
        self.copies: dict[str, int] = {}  # alert id -> how many times delivered
        self.waiting: dict[str, tuple] = {}  # expected, not delivered (yet)
        self.strays: dict[str, tuple] = {}  # delivered, not expected (yet)
        self.mismatched: set[str] = set()
        self.duplicates: set[str] = set()
        self.read_through = 0  # the stream's seq
        self.delivered_through = 0  # the newest delivered alert's emit seq

    def expect(self, alerts: list[dict], through_seq: int) -> None:
        for a in alerts:
            key, fields = a["alert_id"], _fields(a)
            self.expected[key] = fields
            if key in self.strays:
                self._match(key, self.strays.pop(key), fields)
            elif key not in self.copies:
                self.waiting[key] = fields
        self.read_through = max(self.read_through, through_seq)

    def delivered(self, alerts: list[dict]) -> None:
        for a in alerts:
            key, fields = a["alert_id"], _fields(a)
            self.copies[key] = self.copies.get(key, 0) + 1
            self.delivered_through = max(self.delivered_through, fields[0])
            if self.copies[key] > 1:
                self.duplicates.add(key)
                continue
            if key in self.waiting:
                self._match(key, fields, self.waiting.pop(key))
            else:
                self.strays[key] = fields

    def forget_deliveries(self) -> None:
        """The emitter's file was replaced or cut: it is read again from its start."""
        self.copies, self.strays, self.mismatched, self.duplicates = {}, {}, set(), set()
        self.waiting, self.delivered_through = dict(self.expected), 0

    def findings(self) -> dict:
        found = {
            "missing": [k for k, f in self.waiting.items() if f[0] < self.delivered_through],
            "duplicate": list(self.duplicates),
            "unexpected": [k for k, f in self.strays.items() if f[0] <= self.read_through],
            "mismatched": list(self.mismatched),
        }
        return {name: {"count": len(ids), "first": sorted(ids, key=_by_seq)[:SHOWN]} for name, ids in found.items()}

    def _match(self, key: str, delivered: tuple, expected: tuple) -> None:
        if delivered != expected:
            self.mismatched.add(key)


def _fields(alert: dict) -> tuple:
    return tuple(alert.get(f) for f in FIELDS)


def _by_seq(alert_id: str) -> tuple:
    """SESSION:SEQ ids in seq order (a forged id that is not one: after them)."""
    _, _, seq = alert_id.rpartition(":")
    return (0, int(seq), alert_id) if seq.isdigit() else (1, 0, alert_id)
