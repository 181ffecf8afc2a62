"""`tape drill NAME`: a fault under load against real processes, then the
same verdict as `tape up` plus the drill's own checks and figures.

Each drill runs the whole default topology (ops/verification/up.py) and, at 30% of the
run (counted from the load's first trade sent), injects its fault. It heals
it (restarts what was killed, resumes what was paused, reconnects what was
cut off) on an event, not at a time: a leader fault once another
sequencer leads a higher term; any other fault once the cluster has
committed a quarter of the run's trades without the node. So a loaded
machine that is slow to elect cannot heal the fault before the failover it
is there to cause. `all` runs every drill in turn and prints one summary
table.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.verification.faults import alter_books, fill, flip_record_byte, mount_tmpfs, unmount_keeping
from tape.ops.verification.local import ClusterError, LocalCluster
from tape.protocol import journal as fmt
from tape.runtime.storage.quarantine import aside_path
from tape.runtime.tuning import DISK_CHECK_EVERY_S

DRILLS = ("kill-leader", "pause-leader", "partition-leader", "kill-standby", "kill-rewinder", "kill-replica",
          "kill-emitter", "both-rewinders-down", "loss", "failover-under-loss", "client-restart", "hostile",
          "wipe-rewinder", "wipe-standby", "corrupt-snapshot", "corrupt-segment", "disk-full", "pause-all-voters")
LAN_DRILLS = ("cut-leader-link", "unplug-rewinder", "lossy-links", "slow-links",  # real network faults: --lan only
              "webhook-unreachable")
CUT_S = 3.0  # cut-leader-link: the leader's cable out at least this long
REJOIN_S = 15.0  # cut-leader-link: the old leader, its cable back, follows the new term within this
LINK_LOSS_PERCENT = 5  # lossy-links: of every packet in and out of the replicas' and rw-1's hosts
# slow-links: each frame 0.5-3.5 ms late (so reordered), 1% of them twice
SLOW_LINK = {"delay_ms": 2.0, "jitter_ms": 1.5, "dup": 0.01}
BITE_WITHIN_S = 10 * DISK_CHECK_EVERY_S  # disk-full: the voter looks at its free space this often, or fails
DISK_FULL_SIZE = "256m"  # the disk-full drill's tmpfs under rw-1: room for the default run's journal
LOSSY = ("loss", "failover-under-loss")  # the drills run with --loss at every receiver
STALL_S = 1.0  # nothing committed for this long: the cluster has stopped (no majority)


def _metric(cluster: LocalCluster, node: str, name: str) -> float | None:
    try:
        return cluster.metrics(node).get(f'{name}{{node="{node}"}}')
    except OSError:
        return None


def _committed(cluster: LocalCluster) -> float:
    """The highest commit point any live sequencer reports."""
    seqs = [_metric(cluster, n.name, "tape_sequencer_commit_seq") for n in cluster.cfg.by_role("sequencer")
            if cluster.alive(n.name)]
    return max((s for s in seqs if s is not None), default=0.0)


class Drill:
    """One fault: `inject` at 30% of the run, `heal` once `healable` says so. `planted`: patterns of
    the log lines its fault causes (any other Traceback or CRITICAL fails the run's verdict)."""

    planted: tuple[str, ...] = ()

    def __init__(self, name: str, duration: float, trades: int):
        self.name = name
        self.duration = duration
        self.heal_after = trades // 4  # trades committed without the node before it is healed
        self.target: str | None = None  # the node the fault hit
        self.injected = self.healed = False
        self.committed_at_fault = 0.0

    def step(self, cluster: LocalCluster, elapsed: float) -> str | None:
        if not self.injected and elapsed >= 0.3 * self.duration and self.ready(cluster):
            self.injected = True
            self.committed_at_fault = _committed(cluster)
            return self.inject(cluster)
        if self.injected and not self.healed and self.healable(cluster):
            self.healed = True
            return self.heal(cluster)
        return None

    def ready(self, cluster: LocalCluster) -> bool:
        """What the fault needs before it can be injected (from 30% of the run on)."""
        return True

    def healable(self, cluster: LocalCluster) -> bool:
        """The event that ends the fault: the cluster went on without the node."""
        return _committed(cluster) >= self.committed_at_fault + self.heal_after

    def finish(self, cluster: LocalCluster) -> None:
        """Heal whatever is still broken when the load ends, then look at the cluster while it runs."""
        if self.injected and not self.healed:
            self.healed = True
            self.heal(cluster)
        self.observe(cluster)

    def observe(self, cluster: LocalCluster) -> None:
        pass

    def prepare(self, cluster: LocalCluster) -> None:
        """Before the nodes start (FaultUnavailable if this machine cannot inject the fault)."""

    def release(self, cluster: LocalCluster) -> None:
        """After the nodes stopped, before the run's files are arranged."""

    def inject(self, cluster: LocalCluster) -> str | None:
        return None

    def heal(self, cluster: LocalCluster) -> str | None:
        return None

    def checks(self, cluster: LocalCluster, report: dict) -> dict:
        return {}


class KillNode(Drill):
    def __init__(self, name: str, duration: float, trades: int, pick):
        super().__init__(name, duration, trades)
        self.pick = pick  # cluster -> node name

    def inject(self, cluster):
        self.target = self.pick(cluster)
        if not self.target:
            return "no target found (no leader?)"
        cluster.kill(self.target)
        return f"kill -9 {self.target}"

    def heal(self, cluster):
        if self.target:
            cluster.restart(self.target)
            return f"restarted {self.target}"
        return None

    def checks(self, cluster, report):
        return {"the node was killed and restarted": (self.target is not None and self.healed, f"{self.target}")}


class LeaderFault(Drill):
    """kill-leader, pause-leader, partition-leader (and failover-under-loss: kill-leader
    with loss at every receiver): a new term must begin under another leader. That the
    old one published nothing in a term it did not win is the verdict's term check, as
    for every run."""

    def __init__(self, name: str, duration: float, trades: int):
        super().__init__(name, duration, trades)
        self.fault = "kill-leader" if name == "failover-under-loss" else name

    def inject(self, cluster):
        self.target = cluster.leader()
        if not self.target:
            return "no leader found"
        self.term_before = _metric(cluster, self.target, "tape_sequencer_term") or 0
        if self.fault == "kill-leader":
            cluster.kill(self.target)
            return f"kill -9 {self.target} (leader, term {self.term_before:.0f})"
        if self.fault == "pause-leader":
            os.kill(cluster.procs[self.target].pid, signal.SIGSTOP)
            return f"SIGSTOP {self.target} (leader, term {self.term_before:.0f})"
        (Path(cluster.cfg.node(self.target).data) / "partitioned").touch()
        return f"cut {self.target} (leader, term {self.term_before:.0f}) off from every voter"

    def healable(self, cluster):
        """Another sequencer leads a higher term (the fault did what it is there to do)."""
        new = cluster.leader()
        return self.target is None or (new is not None and new != self.target)

    def heal(self, cluster):
        if not self.target:
            return None
        if self.fault == "kill-leader":
            cluster.restart(self.target)
            return f"restarted {self.target}: it rejoins as a follower"
        if self.fault == "pause-leader":
            os.kill(cluster.procs[self.target].pid, signal.SIGCONT)
            return f"SIGCONT {self.target}"
        (Path(cluster.cfg.node(self.target).data) / "partitioned").unlink(missing_ok=True)
        return f"healed the partition around {self.target}"

    def observe(self, cluster):
        if self.target:
            time.sleep(0.5)  # a resumed or reconnected old leader has had time to do what it would do

    def checks(self, cluster, report):
        out = {}
        terms = report["terms"]
        after = [t for t in terms if t["term"] > self.term_before]
        new = after[0] if after else None
        changed = new is not None and new["leader"] != self.target
        report["failover_ms"] = new["ms_since_previous_stamp"] if changed else None
        report["old_leader"] = self.target
        report["new_leader"] = new["leader"] if new else None
        out["a new leader took over"] = (changed, f"{self.target} -> {new['leader']} in term {new['term']}" if new
                                         else "no new term")
        # Whether the old leader, back, published in a term it did not win is the verdict's
        # term check ("each term published only by its winner"), for every drill.
        return out


class NoMajority(Drill):
    """both-rewinders-down: two voters of four are no majority. The cluster must stop committing
    (the leader steps down by check-quorum; no one can be elected) and resume when they are back."""

    def inject(self, cluster):
        for rw in ("rw-1", "rw-2"):
            cluster.kill(rw)
        self.last_commit, self.since, self.stalled = _committed(cluster), time.monotonic(), False
        return "kill -9 rw-1 and rw-2: no majority"

    def healable(self, cluster):
        """The event: nothing committed for STALL_S (observed, not assumed)."""
        now, commit = time.monotonic(), _committed(cluster)
        if commit != self.last_commit:
            self.last_commit, self.since = commit, now
        self.stalled = now - self.since >= STALL_S
        return self.stalled

    def heal(self, cluster):
        for rw in ("rw-1", "rw-2"):
            cluster.restart(rw)
        return f"restarted rw-1 and rw-2 (commits stopped at seq {self.last_commit:,.0f})"

    def checks(self, cluster, report):
        return {"commits stopped without a majority": (self.stalled, f"at seq {self.last_commit:,.0f}")}


class PauseAllVoters(Drill):
    """pause-all-voters: every voter stopped at once for twice the minimum election timeout (what
    a host-wide stall does: swap, an fsync storm, a frozen VM), then resumed. No voter heard the
    others meanwhile, but none was listening either: there must be no election (the election's
    timers hold over a stall of their own process, protocol/election.py)."""

    def inject(self, cluster):
        self.term_before = _metric(cluster, cluster.leader() or "seq-a", "tape_sequencer_term") or 0
        self.pause_s = 2 * cluster.cfg.election_ms / 1000
        voters = [n.name for n in cluster.cfg.voters]
        for name in voters:
            os.kill(cluster.procs[name].pid, signal.SIGSTOP)
        time.sleep(self.pause_s)  # the fault is a stall of this length
        for name in voters:
            os.kill(cluster.procs[name].pid, signal.SIGCONT)
        self.healed = True
        return f"SIGSTOP {', '.join(voters)} for {self.pause_s * 1000:.0f} ms, then SIGCONT " \
               f"(term {self.term_before:.0f})"

    def checks(self, cluster, report):
        terms = [t["term"] for t in report["terms"]]
        return {"no election over a stall of every voter": (self.injected and len(terms) == 1,
                                                             f"terms {terms}")}


class ClientRestart(Drill):
    """client-restart: kill -9 the load generator mid-stream and start it again with --resume,
    once it is dead. It must find in the stream what was sequenced and submit the rest: every
    trade once (the verdict), nothing twice although in-flight batches may still arrive."""

    def inject(self, cluster):
        cluster.kill("load")
        self.target = "load"
        return "kill -9 load (the client)"

    def healable(self, cluster):
        return not cluster.alive("load")

    def heal(self, cluster):
        args = cluster.started["load"][0]
        cluster.start("load", *args, *(() if "--resume" in args else ("--resume",)))
        return "restarted load with --resume"

    def checks(self, cluster, report):
        resumed = report.get("resumed_at") or 0
        return {"the client restarted and resumed after what was sequenced": (
            self.healed and 0 < resumed < report["submitted"], f"at trade {resumed:,}")}


class Hostile(Drill):
    """hostile: the attacks of issue 13 (ops/verification/hostile.py), sent by an outsider without keys at 30% of
    the run: forged stream packets, end of session and far heartbeats to the group, undecodable
    unicast to every replica socket, forged votes, appends and acks, a forged alert, a batch under a
    client's name, a gap-fill flood, random bytes at every socket of every process; and, with the
    keys a replica's host holds, votes and appends to the voters and an alert in another replica's
    name. No node may stop
    (a node that exits aborts the run) or take the forged term; the verdict shows that nothing
    forged was applied, delivered or journaled; each kind of forgery was counted where it landed."""

    REFUSALS = {  # (role, metric, reason or None for any): where each kind of attack is counted
        "stream packets refused by the replicas": ("replica", "bad_datagrams", "unsealed"),
        "a client's keys refused by the replicas": ("replica", "bad_datagrams", "bad_tag"),
        "links refused by the voters": ("voters", "link_refused", None),
        "links refused by the emitter": ("emitter", "link_refused", None),
        "a replica's keys refused by the voters": ("voters", "link_refused", "unknown_key"),
        "a replica in another's name refused by the emitter": ("emitter", "rejected", "not_the_peer"),
        "batches refused by the sequencers": ("sequencer", "dropped_datagrams", "unauthenticated"),
        "gap requests refused by the rewinders": ("rewinder", "dropped_datagrams", "unsigned_request"),
    }

    def inject(self, cluster):
        from tape.ops.verification.hostile import run_all

        self.sent = run_all(cluster)
        return (f"{len(self.sent)} attacks sent, by an outsider and with a replica's and a client's keys "
                f"(ops/verification/hostile.py)")

    def healable(self, cluster):
        return True  # a burst: nothing to heal; the run goes on under the verdict

    def observe(self, cluster):
        self.refused = {what: self._count(cluster, *where) for what, where in self.REFUSALS.items()}

    @staticmethod
    def _count(cluster: LocalCluster, role: str, metric: str, reason: str | None) -> float:
        nodes = cluster.cfg.voters if role == "voters" else cluster.cfg.by_role(role)
        total = 0.0
        for n in nodes:
            prefix = f"tape_{n.role}_{metric}_total{{node=\"{n.name}\""
            try:
                m = cluster.metrics(n.name)
            except OSError:
                continue
            total += sum(v for k, v in m.items() if k.startswith(prefix) and (reason is None or
                                                                              f'reason="{reason}"' in k))
        return total

    def checks(self, cluster, report):
        from tape.ops.verification.hostile import FORGED_TERM

        report["attacks"] = getattr(self, "sent", [])
        report["refused"] = getattr(self, "refused", {})
        highest = max((t["term"] for t in report["terms"]), default=0)
        out = {"no forged term taken": (highest < FORGED_TERM, f"highest term {highest}")}
        for what, count in report["refused"].items():
            out[what] = (count > 0, f"{count:,.0f}")
        return out


class DiskFault(KillNode):
    """wipe-rewinder, wipe-standby, corrupt-snapshot, corrupt-segment: the node is killed (a disk
    failing takes its host down), its disk wiped or damaged, and it is started again once the
    cluster has gone on without it; it must recover by itself, which its metrics show."""

    def __init__(self, name: str, duration: float, trades: int, pick):
        super().__init__(name, duration, trades, pick)
        self.done = ""
        if name == "corrupt-segment":
            self.planted = ("CRITICAL journal damaged at ",)  # its repair says so, as an operator must hear

    def ready(self, cluster):
        """A snapshot to corrupt: the replica has written one."""
        return self.name != "corrupt-snapshot" or (
            _metric(cluster, self.pick(cluster), "tape_replica_snapshots_total") or 0) >= 1

    def inject(self, cluster):
        self.target = self.pick(cluster)
        if not self.target:
            return "no target found"
        cluster.kill(self.target)
        data = Path(cluster.cfg.node(self.target).data)
        if self.name.startswith("wipe-"):
            aside = aside_path(data, "replaced")
            data.rename(aside)  # the runbook's `tape node replace`: an empty data directory
            data.mkdir()
            self.done = f"its data moved to {aside.name}"
        elif self.name == "corrupt-snapshot":
            self.done = f"{alter_books(data / 'lmdb')} books of its snapshot altered under the checksum"
        else:
            segment = max((data / "journal").glob("*" + fmt.SEGMENT_SUFFIX))
            seq, offset = flip_record_byte(segment)
            self.done = f"a bit flipped at seq {seq} ({segment.name} offset {offset})"
        return f"kill -9 {self.target}; {self.done}"

    def observe(self, cluster):
        self.gauges = {}
        if self.target:
            role = cluster.cfg.node(self.target).role
            for name in ("recovering", "journal_repaired", "snapshots_discarded_total"):
                self.gauges[name] = _metric(cluster, self.target, f"tape_{role}_{name}")

    def checks(self, cluster, report):
        g = getattr(self, "gauges", {})
        if self.name.startswith("wipe-"):
            ok, figure = g.get("recovering") == 0, "election state recovered from every other voter"
        elif self.name == "corrupt-snapshot":
            ok, figure = g.get("snapshots_discarded_total") == 1, "snapshot discarded, rebuilt from seq 1"
        else:
            ok, figure = g.get("journal_repaired") == 1, "journal cut at the damage, refilled from the leader"
        report["fault"] = self.done
        return {"the node was killed, damaged and restarted": (self.healed, f"{self.target}: {self.done}"),
                "recovered without an operator": (ok, figure)}


class DiskFull(Drill):
    """disk-full: rw-1's data on a tmpfs of its own, filled at 30% of the run; it must stop taking
    part without exiting (the others go on), then take part again and catch up once the filler
    is removed (after the cluster committed a quarter of the trades without it). The fault bites
    whatever the journal reserved ahead: with nothing free the voter stops at its next look at
    the free space (FREE_SPACE.stop), within DISK_CHECK_EVERY_S, not only at a refused write."""

    def prepare(self, cluster):
        self.target = "rw-1"
        self.data = Path(cluster.cfg.node(self.target).data)
        self.data.mkdir(parents=True, exist_ok=True)
        mount_tmpfs(self.data, DISK_FULL_SIZE)
        self.mounted = True

    def inject(self, cluster):
        fill(self.data / "filler")
        self.filled_at = time.monotonic()
        return f"filled {self.target}'s file system"

    def healable(self, cluster):
        full = _metric(cluster, self.target, "tape_rewinder_disk_full") == 1
        if not full and time.monotonic() - self.filled_at > BITE_WITHIN_S:
            raise ClusterError(f"the fault did not take effect: {self.target} still takes part "
                               f"{BITE_WITHIN_S:.0f} s after its file system was filled")
        return full and super().healable(cluster)

    def heal(self, cluster):
        (self.data / "filler").unlink()
        return f"removed the filler: {self.target}'s disk has space again"

    def observe(self, cluster):
        deadline = time.monotonic() + 10  # it looks at the free space once a second
        while _metric(cluster, self.target, "tape_rewinder_disk_full") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.full = _metric(cluster, self.target, "tape_rewinder_disk_full")
        self.events = _metric(cluster, self.target, "tape_rewinder_disk_full_events_total")

    def release(self, cluster):
        if getattr(self, "mounted", False):
            unmount_keeping(self.data)

    def checks(self, cluster, report):
        events = getattr(self, "events", None) or 0
        return {"it found its disk full and took no part, without exiting": (events >= 1, f"{events:.0f} refused"),
                "recovered without an operator once space returned": (getattr(self, "full", None) == 0,
                                                                       "took part again, caught up")}


class LinkFault(Drill):
    """On a LAN (ops/verification/lan.py), a real network fault on a host's link:
    cut-leader-link: the leader's host's link down for at least CUT_S and until another sequencer
        leads a higher term, then up (the old leader stepped down by check-quorum meanwhile);
    unplug-rewinder: rw-1's host's link down until the cluster committed a quarter of the run
        without it, then up (it catches up);
    lossy-links: LINK_LOSS_PERCENT of every packet dropped in and out of the replicas' host and
        rw-1's host (nftables: no netem here) until a quarter of the run is committed;
    slow-links: the same two hosts' cables through a forwarder (ops/verification/forwarder.py) that delays,
        jitters (reorders) and duplicates frames, until a quarter of the run is committed."""

    def inject(self, cluster):
        lan = getattr(cluster, "lan", None)
        if lan is None:
            return None  # (make() refuses these without --lan)
        self.lan = lan
        self.at = time.monotonic()
        if self.name == "cut-leader-link":
            self.target = cluster.leader()
            if not self.target:
                return "no leader found"
            self.term_before = _metric(cluster, self.target, "tape_sequencer_term") or 0
        else:
            self.target = "rw-1"
        self.hosts = [self._host(cluster, self.target)]
        if self.name in ("lossy-links", "slow-links"):
            self.hosts.append(self._host(cluster, "replica-A"))
            for h in self.hosts:
                lan.loss(h, LINK_LOSS_PERCENT) if self.name == "lossy-links" else lan.impair(h, **SLOW_LINK)
            what = f"{LINK_LOSS_PERCENT}% loss" if self.name == "lossy-links" else \
                "{delay_ms} ± {jitter_ms} ms delay and {dup:.0%} duplicates".format(**SLOW_LINK)
            return f"{what} in and out of {', '.join(lan.addresses[h] for h in self.hosts)}"
        lan.link(self.hosts[0], up=False)
        return f"{self.target}'s host {lan.addresses[self.hosts[0]]}: link down"

    @staticmethod
    def _host(cluster, node: str) -> int:
        return cluster.lan.addresses.index(cluster.cfg.node(node).host)

    def healable(self, cluster):
        if self.name != "cut-leader-link":
            return super().healable(cluster)
        new = cluster.leader()
        return time.monotonic() - self.at >= CUT_S and new is not None and new != self.target

    def heal(self, cluster):
        if not hasattr(self, "lan"):
            return None
        if self.name in ("lossy-links", "slow-links"):
            for h in self.hosts:
                self.lan.loss(h, 0) if self.name == "lossy-links" else self.lan.unimpair(h)
            return "links plain again"
        self.lan.link(self.hosts[0], up=True)
        self.out_s = time.monotonic() - self.at
        return f"{self.target}'s link up after {self.out_s:.1f} s"

    def observe(self, cluster):
        """cut-leader-link: wait, bounded, for the old leader to follow the new term and hold every
        committed seq (an uncommitted tail of its own term is cut only when the new leader reaches it)."""
        if self.name != "cut-leader-link" or not hasattr(self, "out_s"):
            return
        start = time.monotonic()
        while (rejoined := self._rejoined(cluster)) is False and time.monotonic() - start < REJOIN_S:
            time.sleep(0.1)
        self.rejoin_s = time.monotonic() - start if rejoined else None

    def _rejoined(self, cluster) -> bool:
        leader = cluster.leader()
        if leader is None or leader == self.target:
            return False
        term, commit = (_metric(cluster, leader, f"tape_sequencer_{m}") for m in ("term", "commit_seq"))
        own_term, own_seq = (_metric(cluster, self.target, f"tape_sequencer_{m}") for m in ("term", "sequenced_seq"))
        return None not in (term, commit, own_term, own_seq) and own_term == term and own_seq >= commit

    def checks(self, cluster, report):
        if self.name == "cut-leader-link":
            rejoin_s = getattr(self, "rejoin_s", None)
            rejoined = {"the old leader, its link back, followed the new term": (
                rejoin_s is not None, f"within {rejoin_s:.1f} s of the load's end" if rejoin_s is not None else
                f"not within {REJOIN_S:.0f} s")}
            after = [t for t in report["terms"] if t["term"] > getattr(self, "term_before", 0)]
            new = after[0]["leader"] if after else None
            report["failover_ms"] = after[0]["ms_since_previous_stamp"] if after else None
            return {"a new leader took over while the old one was cut off": (
                new is not None and new != self.target, f"{self.target} -> {new}, link out "
                                                         f"{getattr(self, 'out_s', 0):.1f} s")} | rejoined
        return {"the fault was injected and healed on the LAN": (self.healed and hasattr(self, "lan"),
                                                                 f"{self.target}")}


class WebhookUnreachable(Drill):
    """webhook-unreachable (--lan): the emitter also posts every alert to a webhook receiver on a
    sixth host (ops/verification/webhook_receiver.py); that host's link goes down until the emitter has had to
    retry and a quarter of the run is committed, then up. Every alert must reach the webhook (once
    by its Idempotency-Key: a consumer dedups on it), in order behind the held ones, none lost."""

    webhook = True

    def inject(self, cluster):
        self.lan = cluster.lan
        self.lan.link(len(self.lan.hosts) - 1, up=False)
        return f"the webhook's host {self.lan.addresses[-1]}: link down"

    @staticmethod
    def _retries(cluster) -> float:
        return sum(v for k, v in cluster.metrics("emitter").items()
                   if k.startswith("tape_emitter_sink_retries_total") and 'sink="webhook"' in k)

    def healable(self, cluster):
        return super().healable(cluster) and self._retries(cluster) > 0

    def heal(self, cluster):
        self.retries = self._retries(cluster)
        self.lan.link(len(self.lan.hosts) - 1, up=True)
        return f"the webhook's host back after {self.retries:.0f} retries"

    def observe(self, cluster):
        deadline = time.monotonic() + 30  # the held alerts drain once the host answers
        while time.monotonic() < deadline and len(self._keys(cluster)) < (
                _metric(cluster, "emitter", "tape_emitter_alerts_delivered_total") or 0):
            time.sleep(0.2)

    @staticmethod
    def _keys(cluster) -> list[str]:
        posts = getattr(cluster, "posts", None)
        if posts is None or not posts.exists():
            return []
        # `<alert id>/<the emitter's origin>`, one origin (replicas/sinks.py WebhookSink)
        keys = [json.loads(line)["key"].rsplit("/", 1) for line in posts.read_text().splitlines()]
        return [alert_id for alert_id, _ in keys] if len({origin for _, origin in keys}) <= 1 else []

    def checks(self, cluster, report):
        keys = self._keys(cluster)
        sink = Path(cluster.cfg.node("emitter").data) / "alerts.jsonl"
        delivered = [json.loads(line)["alert_id"] for line in sink.read_text().splitlines()] if sink.exists() else []
        report["webhook_posts"], report["webhook_retries"] = len(keys), getattr(self, "retries", 0)
        return {"every alert reached the webhook, none lost": (
                    set(keys) == set(delivered) and len(delivered) > 0,
                    f"{len(set(keys)):,} alerts, {len(keys) - len(set(keys))} posted twice"),
                "the emitter held them while the host was gone": (getattr(self, "retries", 0) > 0,
                                                                  f"{getattr(self, 'retries', 0):.0f} retries")}


def _standby(cluster: LocalCluster) -> str | None:
    return next((s.name for s in cluster.cfg.by_role("sequencer") if s.name != cluster.leader()), None)


def make(name: str, duration: float, trades: int) -> Drill:
    if name in ("kill-leader", "pause-leader", "partition-leader", "failover-under-loss"):
        return LeaderFault(name, duration, trades)
    picks = {
        "kill-standby": _standby,
        "kill-rewinder": lambda c: "rw-1",
        "kill-replica": lambda c: "replica-B",
        "kill-emitter": lambda c: "emitter",
    }
    if name in picks:
        return KillNode(name, duration, trades, picks[name])
    if name == "both-rewinders-down":
        return NoMajority(name, duration, trades)
    if name == "loss":
        return Drill(name, duration, trades)
    if name == "client-restart":
        return ClientRestart(name, duration, trades)
    if name == "pause-all-voters":
        return PauseAllVoters(name, duration, trades)
    if name == "hostile":
        return Hostile(name, duration, trades)
    disks = {
        "wipe-rewinder": lambda c: "rw-1",
        "wipe-standby": _standby,
        "corrupt-snapshot": lambda c: "replica-B",
        "corrupt-segment": lambda c: "rw-1",
    }
    if name in disks:
        return DiskFault(name, duration, trades, disks[name])
    if name == "disk-full":
        return DiskFull(name, duration, trades)
    if name == "webhook-unreachable":
        return WebhookUnreachable(name, duration, trades)
    if name in LAN_DRILLS:
        return LinkFault(name, duration, trades)
    raise SystemExit(f"unknown drill {name!r}: {', '.join(DRILLS)} or all")


def run(name: str, rate: float, duration: float, loss: float, out: str | None, seed: int, lan: bool = False,
        durability: str | None = None) -> int:
    from tape.ops.verification.up import run_up

    console = Console()
    if name in LAN_DRILLS and not lan:
        raise SystemExit(f"tape drill {name} is a fault on a real link: run it with --lan (root: network namespaces)")
    names = (*DRILLS, *(LAN_DRILLS if lan else ())) if name == "all" else (name,)
    results = {}
    for n in names:
        drill = make(n, duration, int(rate * duration))
        drop = loss if n in LOSSY else 0.0
        where = str(Path(out) / n) if out and name == "all" else out
        results[n] = run_up(rate, duration, drop, where, seed, drill=drill, console=console, lan=lan,
                            durability=durability)
    if name == "all":
        table = Table(title="tape drill all")
        for col in ("drill", "verdict", "failover ms", "rate msg/s", "p99 inbound to applied ms"):
            table.add_column(col, justify="left" if col == "drill" else "right")
        for n, r in results.items():
            fo = r.get("failover_ms")
            table.add_row(n, "[green]pass[/green]" if r["verdict"] == "pass" else "[red]FAIL[/red]",
                          f"{fo:.0f}" if fo is not None else "", f"{r['rate_msgs_per_s']:,.0f}",
                          f"{r['latency_ms'].get('p99') or 0:.1f}")
        console.print(table)
        if out:
            summary = {n: {k: r.get(k) for k in ("verdict", "failover_ms", "rate_msgs_per_s", "latency_ms")}
                       for n, r in results.items()}
            (Path(out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(r["verdict"] == "pass" for r in results.values()) else 1
