"""A voter's journal found damaged at start-up: cut at the damage, recover the rest from peers.

A record that fails its check (not a torn tail, which the journal itself trims) means the
disk lost or changed data this voter may have acknowledged. The voter cannot trust what it
would vote with, so the damaged segment and every later one are moved aside (kept for a
post-mortem, never deleted), the damaged segment's records before the damage are put back,
and the election state is moved aside too: the node then starts as a voter that lost its
disk (protocol/election.py): it votes only after hearing every other voter, and the leader
catches its journal up from the cut. A damage found while serving stops the process with
exit 5 (runtime/process.py); its restart comes here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from tape.protocol import journal as fmt
from tape.runtime.storage.journal_store import Journal, JournalCorruption
from tape.runtime.storage.quarantine import aside_path

log = logging.getLogger("tape.journal")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cut_at_damage(journal_dir: Path, damage: JournalCorruption) -> Path:
    """Move the damaged segment and every later one aside, and put back the damaged segment's
    records before the damage. Returns the directory they went to."""
    aside = aside_path(journal_dir, "damaged")
    aside.mkdir()
    for seg in sorted(journal_dir.glob("*" + fmt.SEGMENT_SUFFIX)):
        if seg.name >= damage.path.name:  # names are zero-padded first seqs: they sort as seqs
            seg.rename(aside / seg.name)
            index = seg.with_suffix(fmt.INDEX_SUFFIX)
            if index.exists():
                index.rename(aside / index.name)
    if damage.offset > fmt.SEGMENT_HEADER_SIZE:
        with open(aside / damage.path.name, "rb") as f:
            good = f.read(damage.offset)
        with open(damage.path, "wb") as f:
            f.write(good)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(journal_dir)
    return aside


def open_checked(open_journal: Callable[[], Journal], data: Path, build: Callable[[Journal], object]):
    """(journal, build(journal), what was repaired or None): `build` reads the whole journal
    (the voter's log state), so a damage anywhere shows here; it is cut once and built again."""
    note = None
    for attempt in range(2):
        journal = None
        try:
            journal = open_journal()
            return journal, build(journal), note
        except JournalCorruption as e:
            if journal is not None:
                journal.close()
            if attempt:
                raise
            aside = cut_at_damage(data / "journal", e)
            election = data / "election.json"
            if election.exists():
                election.rename(aside_path(election, "damaged"))
            note = f"{e.path.name} offset {e.offset} (seq {e.seq}): {e.reason}"
            log.critical("journal damaged at %s; cut there (the damaged segment and later ones moved to %s, the "
                         "election state set aside): recovering the rest from the other voters", note, aside)
    raise AssertionError("unreachable")
