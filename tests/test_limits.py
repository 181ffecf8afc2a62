"""The limits' relations hold, and the leader never builds an append larger than a follower accepts."""

import importlib

import pytest

from tape.protocol import limits, messages, moldudp64
from tape.protocol import replication as rep
from tape.sequencer.leader_core import LeaderCore


def test_a_broken_relation_fails_at_import(monkeypatch):
    monkeypatch.setattr(rep, "MAX_FRAME", 1 << 20)  # smaller than a full batch
    with pytest.raises(AssertionError, match="a batch must fit one append frame"):
        importlib.reload(limits)
    monkeypatch.undo()
    importlib.reload(limits)


def test_the_largest_batch_encodes_within_a_replication_frame():
    core = LeaderCore(b"TAPE      ", b"seq-a     ", 1, [b"rw-1      "], {b"load0     ": None})
    client = moldudp64.session_bytes("load0")
    per_datagram = (moldudp64.MAX_UDP_PAYLOAD - moldudp64.HEADER_SIZE) // messages.INBOUND_BLOCK_SIZE
    body = [messages.purchase_request(i, 10, "c", "S") for i in range(per_datagram)]
    cseq = 1
    while core.pending < limits.MAX_BATCH_MESSAGES:  # as the shell's drain: flush once the limit is reached
        assert core.on_inbound(moldudp64.encode_packet(client, cseq, body), 0) is None
        cseq += per_datagram
    batch = core.flush(1, 1)
    frame = rep.encode_append(1, b"seq-a     ", batch.prev_seq, batch.prev_term, 0, 1, batch.messages)
    assert len(batch.messages) < limits.MAX_BATCH_MESSAGES + per_datagram
    assert len(frame) <= limits.REPLICATION_FRAME


def test_a_broken_tuning_relation_fails_at_import(monkeypatch):
    from tape.runtime import tuning

    monkeypatch.setattr(moldudp64, "MAX_UDP_PAYLOAD", tuning.DATAGRAM_BUFFER + 1)
    with pytest.raises(AssertionError, match="a recv\\(\\) must hold any datagram"):
        importlib.reload(tuning)
    monkeypatch.undo()
    importlib.reload(tuning)


def test_no_shell_keeps_a_tuning_constant_of_its_own():
    """Process tuning is named once, in runtime/tuning.py: a module-level number in a shell is a
    format constant, an exit code or a default of the config, never a buffer, read or timeout."""
    import ast
    from pathlib import Path

    from tape.runtime import tuning

    tuned = {name for name in vars(tuning) if name.isupper()}
    root = Path(__file__).resolve().parent.parent
    again = []
    for path in [*root.glob("runtime/**/*.py"), *root.glob("sequencer/*.py"), *root.glob("rewinder/*.py"),
                 *root.glob("replicas/*.py"), *root.glob("protocol/*.py")]:
        if path.name == "tuning.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                again += [f"{path.name}: {t.id}" for t in node.targets if isinstance(t, ast.Name) and t.id in tuned]
    assert again == []
