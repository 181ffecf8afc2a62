"""Every drill of `tape drill all` against real processes, at a reduced rate and
duration, each judged by the verdict of DESIGN.md section 9 plus its own checks."""

import io
import json
import subprocess

import pytest
from conftest import TAPE, needs_root
from rich.console import Console

from tape.ops.verification.drill import DRILLS, Drill
from tape.ops.verification.load import SENDING
from tape.ops.verification.up import run_up

pytestmark = pytest.mark.process


LEADER_DRILLS = ("kill-leader", "pause-leader", "partition-leader", "failover-under-loss")


ROOT_DRILLS = ("disk-full",)  # fills a tmpfs mounted under the node's data


@pytest.mark.parametrize("drill", [pytest.param(d, marks=needs_root) if d in ROOT_DRILLS else d for d in DRILLS])
def test_every_drill_passes_its_verdict(tmp_path, drill):
    out = subprocess.run(TAPE + ["drill", drill, "--rate", "4000", "--duration", "5", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "pass" and report["drill"] == drill and all(report["checks"].values())
    assert report["sequenced"] == 20_000 and report["duplicates"] == 0 and report["term_problems"] == []
    if drill in LEADER_DRILLS:
        assert report["new_leader"] not in (None, report["old_leader"])
        assert report["failover_ms"] > 0  # measured from the journal's stamps; no bound (tests assert no durations)
        assert "failover" in out.stdout and f"{report['failover_ms']:.0f} ms" in out.stdout
    elif drill == "both-rewinders-down":
        assert report["checks"]["commits stopped without a majority"]
    elif drill == "client-restart":  # the second client found what the first had sequenced
        assert 0 < report["resumed_at"] < report["submitted"] == report["acknowledged"] == 20_000
    elif drill == "hostile":  # every attack sent, every kind refused where it landed, no forged term
        assert len(report["attacks"]) == 12 and report["checks"]["no forged term taken"]
        assert len(report["refused"]) == 8 and all(n > 0 for n in report["refused"].values())
    elif drill in ("wipe-rewinder", "wipe-standby", "corrupt-snapshot", "corrupt-segment", "disk-full"):
        assert report["checks"]["recovered without an operator"] if drill != "disk-full" else \
            report["checks"]["recovered without an operator once space returned"]
    elif drill == "pause-all-voters":  # a stall of every process at once is no reason to elect
        assert report["checks"]["no election over a stall of every voter"] and len(report["terms"]) == 1
    elif drill != "loss":
        assert report["checks"]["the node was killed and restarted"]


@pytest.mark.parametrize("drill", ["kill-leader", "pause-leader"])
def test_failover_drills_pass_with_durability_replicated(tmp_path, drill):
    """Journals flushed in the background: a leader killed (its writes in the page cache, which
    outlives it) or silent hands over every committed record all the same; the run says which
    durability it ran."""
    out = subprocess.run(TAPE + ["drill", drill, "--rate", "4000", "--duration", "5", "--durability", "replicated",
                                 "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "pass" and report["durability"] == "replicated" and report["sequenced"] == 20_000
    assert report["new_leader"] not in (None, report["old_leader"]) and report["duplicates"] == 0
    assert "durability replicated: a record is committed once a majority" in " ".join(out.stdout.split())


def test_the_term_check_judges_terms_not_names():
    from tape.ops.verification.verdict import term_problems

    terms = [{"seq": 1, "term": 1, "leader": "seq-a"}, {"seq": 100, "term": 2, "leader": "seq-b"},
             {"seq": 200, "term": 3, "leader": "seq-a"}]
    # seq-a losing term 2 and winning term 3 back is legitimate.
    ok = {"seq-a": {"1": [1, 99], "3": [200, 250]}, "seq-b": {"2": [100, 199]}}
    assert term_problems(terms, ok) == []
    # A zombie: seq-a publishing in term 1 after term 2 began, or in term 2, which it did not win.
    zombie = {**ok, "seq-a": {"1": [1, 120]}}
    assert term_problems(terms, zombie) == ["seq-a published seqs 1-120 outside term 1's 1-99"]
    assert term_problems(terms, {**ok, "seq-a": {"2": [150, 160]}}) == [
        "seq-a published seqs 150-160 in term 2, which seq-b won"]
    assert term_problems(terms, {"seq-c": {"4": [300, 301]}}) == [
        "seq-c published seqs 300-301 in term 4, which no one won"]


class FirstLook(Drill):
    """No fault: notes, at its first step, the run's clock and whether the load had begun to send."""

    def __init__(self, duration: float, trades: int):
        super().__init__("first-look", duration, trades)
        self.first: tuple[float, bool] | None = None

    def step(self, cluster, elapsed: float):
        if self.first is None:
            self.first = (elapsed, SENDING in cluster.logs["load"].read_text())
        return super().step(cluster, elapsed)


def test_a_drills_clock_starts_when_the_load_begins_to_send(tmp_path):
    """The load starts, then builds all its trades before it sends the first: a drill that injects
    at 30% of the run counts from the first trade sent, not from the load's start."""
    drill = FirstLook(2.0, 4000)
    report = run_up(2000, 2.0, 0.0, str(tmp_path / "run"), 1, drill=drill, console=Console(file=io.StringIO()))
    assert report["verdict"] == "pass", report
    _, sending = drill.first
    assert sending  # (a clock started with the load would step first while it still built its trades)
