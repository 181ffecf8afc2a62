"""`tape journal dump` and `tape journal verify`."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from tape.protocol import messages
from tape.protocol.errors import ProtocolError
from tape.runtime.storage.journal_store import Journal, JournalCorruption


def record_dict(seq: int, term: int, raw: bytes) -> dict:
    """One journal record as a JSON-friendly dict."""
    try:
        out = {"seq": seq, "term": term}
        out.update(messages.to_dict(messages.decode(raw)))
        return out
    except ProtocolError as e:
        return {"seq": seq, "term": term, "error": str(e), "hex": raw.hex()}


def open_existing(path: str) -> Journal:
    journal = Journal(path, readonly=True)
    if not journal.segments:
        raise FileNotFoundError(f"no journal segments (*.seg) in {path}")
    return journal


def dump(path: str, from_seq: int, to_seq: int | None, form: str, out: TextIO) -> int:
    try:
        journal = open_existing(path)
        lines = []
        for seq, term, raw in journal.read(from_seq, to_seq):
            rec = record_dict(seq, term, raw)
            if form == "jsonl":
                lines.append(json.dumps(rec, separators=(",", ":")))
            else:
                lines.append(" ".join(f"{k}={v}" for k, v in rec.items()))
            if len(lines) >= 4096:
                out.write("\n".join(lines) + "\n")
                lines.clear()
        if lines:
            out.write("\n".join(lines) + "\n")
    except JournalCorruption as e:
        print(f"tape journal dump: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"tape journal dump: {e}", file=sys.stderr)
        return 1
    if journal.recovery:
        r = journal.recovery
        print(f"tape journal dump: note: {r.truncated_bytes} bytes after offset {r.offset} of {r.segment} "
              f"are an incomplete tail ({r.reason})", file=sys.stderr)
    return 0


def verify(path: str, out: TextIO) -> int:
    try:
        journal = open_existing(path)
        count = 0
        bad = 0
        for seq, term, raw in journal.read():
            count += 1
            try:
                messages.decode(raw)
            except ProtocolError as e:
                bad += 1
                print(f"seq {seq}: message does not decode: {e}", file=out)
    except JournalCorruption as e:
        print(f"CORRUPT: {e}", file=out)
        return 1
    except FileNotFoundError as e:
        print(f"tape journal verify: {e}", file=sys.stderr)
        return 1
    tail = f"; incomplete tail of {journal.recovery.truncated_bytes} bytes" if journal.recovery else ""
    print(f"{count} records in {len(journal.segments)} segments, seqs {journal.first_seq}..{journal.last_seq}, "
          f"{bad} undecodable{tail}", file=out)
    return 1 if bad else 0


def digest(path, to_seq: int | None = None) -> tuple[int, str]:
    """(records, BLAKE2b-128 of their messages in seq order) of a journal:
    equal journals, or a listener's stream and a journal, compare by it."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    n = 0
    for _, _, m in Journal(path, readonly=True).read(1, to_seq):
        h.update(m)
        n += 1
    return n, h.hexdigest()
