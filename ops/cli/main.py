"""The `tape` command line. Subcommands import their modules lazily so that
`tape --help` and argument errors answer at once."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tape.runtime.exits import EXIT_CONFIG, EXIT_NOT_HERE

EXTRA_OF = {"pyspark": "spark", "pyarrow": "spark", "matplotlib": "plots"}  # pyproject.toml's extras


def _journal_dump(args) -> int:
    from tape.ops.cli.journal_tool import dump

    return dump(args.path, args.from_seq, args.to_seq, args.format, sys.stdout)


def _journal_verify(args) -> int:
    from tape.ops.cli.journal_tool import verify

    return verify(args.path, sys.stdout)


def _journal_export(args) -> int:
    from tape.ops.spark.source import parse_conf, session

    spark = session(args.master, "tape-export", parse_conf(args.conf))
    try:
        df = spark.read.format("tape").load(args.path)
        df.write.mode("overwrite").parquet(args.out)
        count = spark.read.parquet(args.out).count()
    finally:
        spark.stop()
    print(f"{count:,} records written to {args.out} (Parquet)")
    return 0


def _bench_protocol(args) -> int:
    from tape.ops.bench.throughput import bench_protocol, set_clock

    set_clock(args.clock)
    bench_protocol(args.messages, args.batch)
    return 0


def _bench_stream(args) -> int:
    from tape.ops.bench.throughput import bench_stream, set_clock

    set_clock(args.clock)
    bench_stream([float(r) for r in args.rates.split(",")], args.seconds, args.sequencer_only, args.standby,
                 args.messages, args.endpoint)
    return 0


def _bench_failover(args) -> int:
    from tape.ops.bench.throughput import bench_failover

    result = bench_failover(args.runs, args.rate, args.duration)
    return 0 if all(v == "pass" for v in result["verdicts"]) else 1


def _bench_cluster(args) -> int:
    from tape.ops.bench.cluster_cpu import bench_cluster

    bench_cluster([float(r) for r in args.rates.split(",")], args.short, args.long, args.out, args.max_packet,
                  args.durability)
    return 0


def _bench_links(args) -> int:
    from tape.ops.bench.link_costs import bench_links

    bench_links(args.rate, args.batch, args.batches, args.packets)
    return 0


def _bench_metrics_flood(args) -> int:
    from tape.ops.bench.floods import bench_metrics_flood

    bench_metrics_flood(args.rate, args.duration, args.pairs)
    return 0


def _bench_replays(args) -> int:
    from tape.ops.bench.floods import bench_replays

    bench_replays(args.rate, args.duration, args.sessions, args.pairs)
    return 0


def _bench_disk(args) -> int:
    from tape.ops.bench.disk import bench_disk

    bench_disk(args.writers, args.appends, args.messages, args.every_ms, args.dir)
    return 0


def _bench_batch_cost(args) -> int:
    from tape.ops.bench.batch_cost import bench_batch_cost

    return 0 if bench_batch_cost(args.rate, args.window, args.out, args.durability) else 1


def _bench_spark(args) -> int:
    from tape.ops.bench.throughput import bench_spark

    bench_spark(args.messages, args.master, args.keep)
    return 0


def _bench_spark_stream(args) -> int:
    from tape.ops.bench.spark_stream import bench_spark_stream

    bench_spark_stream(args.messages, args.rate, args.duration, args.master)
    return 0


def _bench_rewinder(args) -> int:
    from tape.ops.bench.throughput import bench_rewinder, set_clock

    set_clock(args.clock)
    rate = bench_rewinder(args.messages, args.batch, args.fsync)
    print(f"rewinder on one core: {rate:,.0f} msg/s journaled (fsync {args.fsync}) and acknowledged, "
          f"appends of {args.batch}" + (", in CPU time" if args.clock == "cpu" else ""))
    if args.endpoint:
        from tape.ops.bench.rewinder_endpoint import bench_endpoint

        run = bench_endpoint(args.messages, args.batch, args.fsync)
        print(f"rewinder's endpoint over TCP, a leader ahead of it: {run.rate:,.0f} msg/s journaled (fsync "
              f"{args.fsync}) and acknowledged, {run.cpu_us:.2f} us of CPU a message, {run.fsyncs:,} fsyncs for "
              f"{-(-args.messages // args.batch):,} appends of {args.batch}")
    return 0


def _bench_replica(args) -> int:
    from tape.ops.bench.throughput import bench_replica, set_clock

    set_clock(args.clock)
    bench_replica(args.messages, args.open_orders)
    if args.endpoint:
        from tape.ops.bench.replica_endpoint import bench_replica_endpoint

        run = bench_replica_endpoint(args.messages)
        print(f"the replica process, a leader and the emitter on the other core: {run.rate:,.0f} msg/s checked, "
              f"ordered and applied, {run.cpu_us:.2f} us of CPU a message, {run.alerts:,} alerts sent")
    return 0


def _demo(args) -> int:
    from tape.ops.cli.demo import run_demo

    return run_demo(args.messages, args.rate, args.out, args.drop, args.seed)


def _config(args):
    from tape.runtime.config import ConfigError, load

    try:
        return load(args.config)
    except ConfigError as e:
        print(f"tape: config error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _check_keys_held(cfg, name: str, role: str) -> None:
    """With keys, the file holds every key the node needs: else it was written for another host."""
    from tape.runtime.settings import may_link

    keyless = [c.name for c in cfg.clients if not c.key]
    unpaired = [p.name for p in cfg.nodes if cfg.links_keyed and may_link(role, p.role) and p.name != name
                and not cfg.pair_keys(name, p.name)]
    if unpaired:
        print(f"tape: node {name}: no link key shared with {', '.join(unpaired)} in this file (is this its host's "
              f"file? tape config --out)", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    if role == "sequencer" and cfg.links_keyed and keyless:
        print(f"tape: node {name}: client {keyless[0]} has no key in this file, and a sequencer checks every "
              f"client's batches (is this the sequencer's host's file? tape config --out)", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)


def _node(cfg, name: str, role: str):
    """The node `name` of `role`, checked against this host: the address it binds is one of this
    host's, and its multicast interface (resolved to an address) too, where the role uses one."""
    from tape.runtime import interfaces

    try:
        node = cfg.node(name)
    except KeyError as e:
        print(f"tape: {e.args[0]}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    if node.role != role:
        print(f"tape: node {name} is a {node.role}, not a {role}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    _check_keys_held(cfg, name, role)
    for table, tls in (("metrics", lambda: cfg.metrics_tls), ("replay", lambda: node.soup_port and cfg.soup_tls)):
        try:
            tls()
        except OSError as e:  # (ssl.SSLError is one): a certificate or key that cannot be read or used
            print(f"tape: node {name}: [{table}] TLS files: {e}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from None
    if not interfaces.is_local(node.host):
        raise interfaces.InterfaceError(f"node {name}: host {node.host} is not an address of this host (have: "
                                   f"{', '.join(a for addrs in interfaces.local_ipv4().values() for a in addrs)}): "
                                   f"is this the host it lives on?")
    if role in ("sequencer", "replica"):
        try:
            node.interface = interfaces.resolve(cfg.interface_of(node))
        except interfaces.InterfaceError as e:
            raise interfaces.InterfaceError(f"node {name}: {e}") from None
    return node


def _run_node(make) -> int:
    """Build the runtime (`make()`), serve its metrics, tune its memory for the long run, and run it.
    Fail-stop, from the start: an impossible state found while loading it (an unreadable election
    state, say) is one CRITICAL line and exit 4, as it is while it runs."""
    from tape.protocol.errors import InvariantViolation
    from tape.protocol.extensions import missing
    from tape.runtime import metrics
    from tape.runtime.memory import tune_memory
    from tape.runtime.process import EXIT_INVARIANT

    try:
        runtime = make()
    except InvariantViolation as e:
        logging.getLogger("tape").critical("impossible state at start: %s; stopping (exit %d)", e, EXIT_INVARIANT)
        return EXIT_INVARIANT
    if gone := missing():
        logging.getLogger("tape").warning("C speed-ups off (%s): built without a C compiler, or TAPE_PURE set; "
                                          "the same functions run in Python, slower", ", ".join(gone))
    node = runtime.node
    metrics.serve(node.metrics_port, runtime.METRICS_PREFIX, node.name, runtime.metrics, node.metrics_address,
                  runtime.cfg.metrics_tls)
    tune_memory()
    return runtime.run()


def _sequencer(args) -> int:
    from tape.sequencer.sequencer_shell import Sequencer

    cfg = _config(args)
    node = _node(cfg, args.node, "sequencer")
    return _run_node(lambda: Sequencer(cfg, node, args.drop, args.seed))


def _rewinder(args) -> int:
    from tape.rewinder.rewinder_shell import Rewinder

    cfg = _config(args)
    node = _node(cfg, args.node, "rewinder")
    return _run_node(lambda: Rewinder(cfg, node, args.drop, args.seed))


def _replica(args) -> int:
    from tape.replicas.replica_shell import Replica

    cfg = _config(args)
    node = _node(cfg, args.node, "replica")
    return _run_node(lambda: Replica(cfg, node, args.drop, args.seed, args.exit_on_end))


def _emitter(args) -> int:
    from tape.replicas.emitter_shell import Emitter

    cfg = _config(args)
    node = _node(cfg, args.node, "emitter")
    if args.sinks:
        node.sinks = args.sinks.split(",")
    if args.webhook_url:
        node.webhook_url = args.webhook_url

    def make() -> Emitter:
        try:
            return Emitter(cfg, node, args.crash_at, args.crash_after)
        except ValueError as e:  # a sink's settings
            raise SystemExit(f"tape: emitter {node.name}: {e}") from None
    return _run_node(make)


def _up(args) -> int:
    from tape.ops.verification.up import main

    return main(args.rate, args.duration, args.drop, args.out, args.seed, args.delivery, args.lan, args.runs,
                args.max_packet, args.book_ttl, args.durability)


def _sim(args) -> int:
    from tape.ops.verification.sim import main

    return main(args.first, args.seeds, args.verbose, args.jobs)


def _drill(args) -> int:
    from tape.ops.verification.drill import run

    return run(args.name, args.rate, args.duration, args.loss, args.out, args.seed, args.lan, args.durability)


def _audit(args) -> int:
    from tape.ops.spark.source import parse_conf

    cfg = _config(args)
    if args.follow or args.out:  # the live audit: the stream, reconciled as it goes
        from tape.ops.spark.live_audit import follow

        if not args.out or bool(args.journal) == bool(args.rewinder):
            raise SystemExit("tape audit --follow: give --out DIR, and --journal PATH or --rewinder NODE")
        return follow(args, cfg.session, int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9), args.master,
                      parse_conf(args.conf))
    from tape.ops.spark.audit_job import audit

    if not args.journal:
        raise SystemExit("tape audit: --journal PATH is required")
    return audit(args.journal, args.alerts, cfg, args.master, args.report, parse_conf(args.conf), args.skip_corrupt)


def _analytics(args) -> int:
    from tape.ops.spark.analytics import run
    from tape.ops.spark.source import parse_conf

    cfg = _config(args)
    return run(args.journal, args.out, int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9), args.master,
               parse_conf(args.conf), args.skip_corrupt, args.window)


def _watch(args) -> int:
    from tape.ops.spark.source import parse_conf
    from tape.ops.spark.watch import run

    if bool(args.journal) == bool(args.rewinder):
        raise SystemExit("tape watch: give --journal PATH, or --rewinder NODE (with --config)")
    cfg = _config(args)
    return run(args, int(cfg.book_ttl_s * 1e9), int(cfg.orphan_ttl_s * 1e9), args.master, parse_conf(args.conf))


def _replay(args) -> int:
    from tape.ops.spark.audit_job import replay

    return replay(args.journal, args.to_lmdb, _config(args), args.resume)


def _node_replace(args) -> int:
    from tape.ops.cli.node_tool import replace

    return replace(_config(args), args.name, sys.stdout)


def _load(args) -> int:
    from tape.ops.verification.load import main

    if not args.rate > 0:
        raise SystemExit("tape load: --rate must be positive")
    cfg = _config(args)
    if args.interface:
        for c in cfg.clients:
            c.interface = args.interface
    return main(cfg, args.client, args.rate, args.duration, args.messages, args.seed, args.drop, args.overfill,
                args.resume)


def _tail(args) -> int:
    from tape.ops.cli.tail import main

    cfg = _config(args)
    if args.interface:
        cfg.interface = args.interface
    return main(cfg, args.stats, args.until, args.drop, args.seed, args.summary, args.idle_exit)


def _onramp(args) -> int:
    from tape.ops.cli.onramp import main

    cfg = _config(args)
    return main(cfg, args.client or cfg.clients[0].name, args.file, args.timeout)


def _config_default(args) -> int:
    from pathlib import Path

    from tape.runtime.config import default_toml, keys_file, new_keys

    if args.action == "keys":
        from tape.ops.cli.config_keys import key_reference

        sys.stdout.write(key_reference())
        return 0
    if args.action and not args.file:
        raise SystemExit(f"tape config {args.action}: which file? (tape config {args.action} FILE)")
    if args.action == "check":
        from rich.console import Console

        from tape.ops.cli.config_check import check

        return check(args.file, args.node, Console())
    if args.action == "units":
        from tape.ops.cli.config_check import units

        return units(args.file, sys.stdout)
    if args.action == "prometheus":
        from tape.ops.cli.scrape_config import ScrapeTlsError, scrape_config

        args.config = args.file
        try:
            sys.stdout.write(scrape_config(_config(args), tls={"ca_file": args.ca_file, "cert_file": args.cert_file,
                                                               "key_file": args.key_file}))
        except ScrapeTlsError as e:
            print(f"tape: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    keys = None if args.no_keys else keys_file(Path(args.keys), args.clients) if args.keys else new_keys(args.clients)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else None
    if args.out:
        from tape.ops.cli.config_out import host_texts, write_host_configs

        if not hosts or args.free_ports:
            raise SystemExit("tape config --out: one file a host of --hosts, with fixed ports (not --free-ports)")
        return write_host_configs(Path(args.out), host_texts(hosts, keys, args.data, args.sequencers, args.rewinders,
                                                             args.replicas, args.clients))
    sys.stdout.write(default_toml(args.data, args.rewinders, args.clients, free=args.free_ports, keys=keys,
                                  replicas=args.replicas, sequencers=args.sequencers, hosts=hosts))
    return 0


def _cluster_options(p: argparse.ArgumentParser, drop: bool = True) -> None:
    p.add_argument("--config", default=None, help="cluster TOML file (default: the embedded loopback cluster)")
    if drop:
        p.add_argument(
            "--drop", type=float, default=0.0, help="fraction of received datagrams to drop, for tests (default 0)"
        )
        p.add_argument("--seed", type=int, default=0, help="seed of the loss injection (default 0)")


def _spark_options(p, skip_corrupt: bool = True) -> None:
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*]; e.g. spark://host:7077)")
    p.add_argument("--conf", action="append", metavar="KEY=VALUE",
                   help="a Spark setting, repeatable (e.g. --conf spark.executor.memory=4g)")
    if skip_corrupt:
        p.add_argument("--skip-corrupt", action="store_true",
                       help="skip corrupt journal records and count them, instead of failing")


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="run the live stream on loopback multicast and check it",
                          description="Start a sequencer, two rewinders, a load generator and a listener as real "
                                      "processes on loopback multicast, show the stream live, then check that every "
                                      "trade was sequenced once and every journal and listener agrees.")
    demo.add_argument("--messages", type=int, default=100_000, help="trades to send (default 100000)")
    demo.add_argument("--rate", type=float, default=20_000, help="trades per second (default 20000)")
    demo.add_argument("--out", default=None, help="directory to keep config, journals and logs (default: temporary)")
    demo.add_argument(
        "--drop", type=float, default=0.02, help="fraction of datagrams every receiver drops (default 0.02)"
    )
    demo.add_argument("--seed", type=int, default=1, help="seed of the trade generator and loss injection")
    demo.set_defaults(func=_demo)


def _add_journal(sub) -> None:
    journal = sub.add_parser("journal", help="inspect journal segments", description="Inspect a journal directory.")
    jsub = journal.add_subparsers(dest="journal_command", metavar="ACTION", required=True)
    dump = jsub.add_parser("dump", help="print decoded messages, one a line",
                           description="Print the journal's messages in seq order.")
    dump.add_argument("path", help="journal directory")
    dump.add_argument("--from", dest="from_seq", type=int, default=1, help="first seq (default 1)")
    dump.add_argument("--to", dest="to_seq", type=int, default=None, help="last seq (default: the end)")
    dump.add_argument("--format", choices=("jsonl", "text"), default="jsonl", help="output format (default jsonl)")
    dump.set_defaults(func=_journal_dump)
    verify = jsub.add_parser("verify", help="check every record's CRC and seq",
                             description="Read the whole journal, checking every record; exit 1 on corruption.")
    verify.add_argument("path", help="journal directory")
    verify.set_defaults(func=_journal_verify)
    export = jsub.add_parser("export", help="write the journal as Parquet (Spark)",
                             description="Read the journal through the tape data source and write it as Parquet, "
                                         "for other tools and for faster repeated analytics.")
    export.add_argument("path", help="journal directory")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--format", choices=("parquet",), default="parquet", help="output format (parquet)")
    _spark_options(export, skip_corrupt=False)
    export.set_defaults(func=_journal_export)


def _add_sequencer(sub) -> None:
    p = sub.add_parser("sequencer", help="run a sequencer node", description="Run a sequencer: stamp inbound "
                       "trades, journal and replicate them, publish committed packets on the multicast stream.")
    _cluster_options(p)
    p.add_argument("--node", default="seq-a", help="this node's name in the config (default seq-a)")
    p.set_defaults(func=_sequencer)


def _add_rewinder(sub) -> None:
    p = sub.add_parser("rewinder", help="run a rewinder node", description="Run a rewinder: follow the leader's "
                       "log, answer gap-fill requests (UDP) and replay sessions (SoupBinTCP over TCP).")
    _cluster_options(p)
    p.add_argument("--node", default="rw-1", help="this node's name in the config (default rw-1)")
    p.set_defaults(func=_rewinder)


def _add_replica(sub) -> None:
    p = sub.add_parser("replica", help="run a replica auditor", description="Run a replica: apply the stream to "
                       "the audit state machine, snapshot to LMDB, send alerts to the emitter.")
    _cluster_options(p)
    p.add_argument("--node", default="replica-A", help="this node's name in the config (default replica-A)")
    p.add_argument("--exit-on-end", action="store_true", help="stop after applying up to the stream's end of session")
    p.set_defaults(func=_replica)


def _add_emitter(sub) -> None:
    p = sub.add_parser("emitter", help="run the alert emitter", description="Run the emitter: receive alerts from "
                       "the replicas and deliver each exactly once to its sinks: a JSON-lines file, an HTTP webhook "
                       "(POST, Idempotency-Key = alert id/origin, retried with back-off) and/or stdout.")
    _cluster_options(p, drop=False)
    p.add_argument("--node", default="emitter", help="this node's name in the config (default emitter)")
    p.add_argument("--sinks", help="comma-separated sinks, overriding the config: jsonl,webhook,stdout")
    p.add_argument("--webhook-url", help="the webhook sink's URL, overriding the config")
    from tape.replicas.emitter_core import CRASH_POINTS

    p.add_argument("--crash-at", choices=CRASH_POINTS, help="fault injection for tests and drills: exit 99 at this "
                   "point of the delivery step (intent, deliver, done)")
    p.add_argument("--crash-after", type=int, default=1, help="with --crash-at: in the N-th batch (default 1)")
    p.set_defaults(func=_emitter)


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="run the whole local cluster and check it",
                       description="Start sequencer, 2 rewinders, 3 replicas, the emitter and a load generator on "
                                   "loopback multicast, show them live, stop them in order and print a verdict "
                                   "against DESIGN.md section 9 (exit 1 on fail).")
    p.add_argument("--rate", type=float, default=20_000, help="trades per second (default 20000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load (default 10)")
    p.add_argument("--drop", type=float, default=0.0, help="fraction of datagrams every receiver drops (default 0)")
    p.add_argument("--out", default=None, help="directory to keep journals, LMDB files, alerts.jsonl, report.json")
    p.add_argument("--seed", type=int, default=1, help="seed of load and loss injection")
    p.add_argument("--delivery", choices=("first", "quorum"), default="first",
                   help="the emitter's delivery: the first copy of an alert, or once two of three replicas agree")
    p.add_argument("--lan", action="store_true", help="over five hosts: network namespaces on a bridge (root)")
    p.add_argument("--runs", type=int, choices=range(1, 1001), metavar="N", default=1,
                   help="run it this many times (seeds SEED, SEED+1, ...; --out DIR/run-N) and print one row per "
                        "run: verdict, terms, the voters' stalls, slow fsyncs and step-downs")
    p.add_argument("--book-ttl", type=float, default=None, metavar="SECONDS",
                   help="how long a book stays open, [audit] book_ttl_s (default: the config's, an hour): a run "
                        "longer than it shows the replicas' memory level off once books close as fast as they open")
    _add_max_packet(p)
    _add_durability(p)
    p.set_defaults(func=_up)


def _add_bench_batch_cost(bsub) -> None:
    bb = bsub.add_parser("batch-cost", help="what one batch costs each process: CPU, wake-ups, system calls, hashes, "
                         "allocations",
                         description="Run the tape up topology at --rate; once the load sends, count with perf over "
                                     "--window seconds each process's CPU time, system calls by kind, wake-ups and "
                                     "preemptions, then over another window with probes its hashes and allocations; "
                                     "print each a batch (the leader's batches in the window), beside this host's "
                                     "floor: a wake-up, and a batch carried along the same nine processes' hops with "
                                     "no work. Needs root and perf.")
    bb.add_argument("--rate", type=float, default=2000, help="trades per second (default 2000)")
    bb.add_argument("--window", type=float, default=5.0, help="seconds each count lasts (default 5)")
    bb.add_argument("--out", default=None, help="write the figures as JSON to this file")
    _add_durability(bb)
    bb.set_defaults(func=_bench_batch_cost)


def _add_durability(p) -> None:
    p.add_argument("--durability", choices=("flush", "replicated"), default=None,
                   help="[journal] durability: \"flush\" (a record is committed once a majority has it on disk) or "
                        "\"replicated\" (in a majority's memory, flushed in the background); default flush on "
                        "loopback, where one power loss takes every voter, replicated with --lan (docs/failover.md)")


def _add_max_packet(p) -> None:
    p.add_argument("--max-packet", type=int, default=None, metavar="BYTES",
                   help="the stream's packet size, [stream] max_packet (default 8972 on loopback, a jumbo frame's "
                        "payload; 1400 on a LAN, an Ethernet frame's)")


def _add_sim(sub) -> None:
    p = sub.add_parser("sim", help="the deterministic simulator: seeds of faults, each checked",
                       description="Run the pure cores of every role on a seeded virtual network and clock with "
                                   "drops, delays, duplicates, reordering, partitions, crashes and pauses; check "
                                   "DESIGN.md section 9 after each seed. A failing seed prints its reproduction.")
    p.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    p.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each seed's figures")
    p.set_defaults(func=_sim)


def _status(args) -> int:
    from tape.ops.cli.status import client_tls, main

    return main(_config(args), args.json, args.watch, client_tls(args.ca_file, args.cert_file, args.key_file))


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="every node of the cluster from its metrics endpoint",
                       description="One row a node, read from its metrics endpoint: role, term, leader, sequenced, "
                                   "committed, published and applied seqs, lag, gap fills, snapshots, digest, "
                                   "datagrams dropped by reason. Exits 1 if a node does not answer or no sequencer "
                                   "(or more than one) leads.")
    p.add_argument("--config", default=None, help="cluster TOML file (default: the embedded loopback cluster)")
    p.add_argument("--json", action="store_true", help="print it as JSON (for scripts)")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    _add_scraper_tls(p, "where the config has [metrics] certfile")
    p.set_defaults(func=_status)


def _add_drill(sub) -> None:
    from tape.ops.verification.drill import DRILLS, LAN_DRILLS

    p = sub.add_parser("drill", help="a failover or fault drill under load, with a verdict",
                       description="Run the whole cluster under load, inject a fault at 30% of the run and heal it "
                                   "once the cluster went on without the node (a new leader, or a quarter of the "
                                   "trades committed), then check DESIGN.md section 9 and the drill's own checks (a "
                                   "new leader, each term published only by its winner, failover_ms). Drills: "
                                   + ", ".join(DRILLS) + "; with --lan also " + ", ".join(LAN_DRILLS)
                                   + "; all runs each in turn. Exits 1 if any verdict fails.")
    p.add_argument("name", choices=(*DRILLS, *LAN_DRILLS, "all"), help="which drill")
    p.add_argument("--rate", type=float, default=50_000, help="trades per second (default 50000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load (default 10)")
    p.add_argument("--loss", type=float, default=0.05, help="loss at every receiver for the loss drill (default 0.05)")
    p.add_argument("--out", default=None, help="keep journals, alerts and report.json here (all: one folder a drill)")
    p.add_argument("--seed", type=int, default=1, help="seed of load and loss injection")
    p.add_argument("--lan", action="store_true", help="over five hosts: network namespaces on a bridge, each node "
                   "in its host's namespace (root; docs/runbook.md, Drills on a LAN)")
    _add_durability(p)
    p.set_defaults(func=_drill)


def _add_audit(sub) -> None:
    p = sub.add_parser("audit", help="reconcile delivered alerts with the journal (Spark)",
                       description="Recompute the expected alerts from the journal in Spark (per order, in seq order, "
                                   "with the replicas' rules) and reconcile them with the delivered alerts: missing, "
                                   "duplicate, unexpected, mismatched. Exits 1 on any finding. With --follow (or "
                                   "--out), the live audit: the stream's alerts reconciled continuously with the "
                                   "emitter's file as both grow, and how far behind the log it is.")
    _cluster_options(p, drop=False)
    p.add_argument("--journal", default=None, help="journal directory (e.g. runs/demo/journal/seq-a)")
    p.add_argument("--alerts", required=True, help="delivered alerts, JSON lines (e.g. runs/demo/alerts.jsonl)")
    p.add_argument("--report", default=None, help="write the findings as JSON to this file (live: at every change)")
    p.add_argument("--follow", action="store_true", help="the live audit: follow the log and the alerts as they "
                   "grow, reconciling continuously (needs --out)")
    p.add_argument("--out", default=None, help="the live audit's directory (its checkpoint and orders' state): "
                   "without --follow, it reads what is committed now, reconciles and stops, and the next run "
                   "goes on from there")
    p.add_argument("--rewinder", default=None, help="the live audit over a rewinder's replay port (its node name "
                   "in --config) instead of --journal")
    p.add_argument("--max-records", type=int, default=None, help="records a micro-batch at most (live; default: all)")
    _spark_options(p)
    p.set_defaults(func=_audit)


def _add_analytics(sub) -> None:
    p = sub.add_parser("analytics", help="journal analytics in Spark: tables, PNG plots, an HTML page",
                       description="Volumes per stock and client, fill ratios and overfill per order book, rejects "
                                   "and orphans by reason, message rate per second and stamp-to-stamp gaps, from a "
                                   "journal or its Parquet export; tables in the terminal, and analytics.json, PNG "
                                   "plots and index.html in --out.")
    _cluster_options(p, drop=False)
    p.add_argument("--journal", required=True, help="journal directory or URI, or a `tape journal export` directory")
    p.add_argument("--out", required=True, help="directory for analytics.json, the plots, index.html and windows/ "
                   "(the volume windows, Parquet, as `tape watch` writes them)")
    _add_window(p)
    _spark_options(p)
    p.set_defaults(func=_analytics)


def _add_window(p) -> None:
    p.add_argument("--window", default="10 seconds", help='volume windows\' length, in Spark\'s words (default "10 '
                   'seconds")')


def _add_watch(sub) -> None:
    p = sub.add_parser("watch", help="the stream live in Spark: volume windows, alerts and rejects",
                       description="Continuous Spark queries over the committed stream, in windows of the "
                                   "sequencer's stamps (a replay gives the windows of the live run): volume and "
                                   "trade count per stock and client, the most active, alerts (overfilled books) "
                                   "and rejects. Shown live in the terminal; each closed window and each finding "
                                   "written once as Parquet under --out, with the checkpoints that let a watch "
                                   "started again go on where it stopped.")
    _cluster_options(p, drop=False)
    p.add_argument("--journal", default=None, help="a journal directory a voter is writing (or has written)")
    p.add_argument("--rewinder", default=None, help="or a rewinder's replay port: its node name in --config")
    p.add_argument("--out", required=True, help="directory for windows/, findings/ (Parquet) and checkpoints/")
    p.add_argument("--from-seq", type=int, default=1, help="the first seq, for a new --out (default 1)")
    p.add_argument("--follow", action="store_true", help="keep following the log (else stop once caught up)")
    _add_window(p)
    p.add_argument("--top", type=int, default=10, help="stocks and clients shown (default 10)")
    p.add_argument("--max-records", type=int, default=None, help="records a micro-batch at most (default: all)")
    _spark_options(p, skip_corrupt=False)
    p.set_defaults(func=_watch)


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="rebuild a replica's LMDB state from a journal",
                       description="Apply a journal to the audit state machine and write its LMDB snapshot, so that "
                                   "a lost or corrupt replica can be restored without the network; prints seq, "
                                   "digest, where it started and what it moved aside.")
    _cluster_options(p, drop=False)
    p.add_argument("--journal", required=True, help="journal directory")
    p.add_argument("--to-lmdb", required=True,
                   help="LMDB directory to write, from seq 1 (a snapshot already there is moved aside)")
    p.add_argument("--resume", action="store_true",
                   help="continue the snapshot in --to-lmdb instead; refused if it does not verify")
    p.set_defaults(func=_replay)


def _add_node(sub) -> None:
    node = sub.add_parser("node", help="operate on one node's data", description="Operate on one node's data.")
    nsub = node.add_subparsers(dest="node_command", metavar="ACTION", required=True)
    p = nsub.add_parser("replace", help="give a stopped voter an empty data directory, safely",
                        description="For a voter whose disk failed or was swapped: move its data directory aside "
                                    "and leave an empty one. Started on it, the node recovers its election state from "
                                    "every other voter before it votes (it never votes twice in a term), then "
                                    "catches up from the leader. Refuses while the node answers on its metrics port.")
    _cluster_options(p, drop=False)
    p.add_argument("name", help="the node's name in the config (a sequencer or rewinder)")
    p.set_defaults(func=_node_replace)


def _add_load(sub) -> None:
    p = sub.add_parser("load", help="submit generated trades at a target rate",
                       description="Generate purchase requests and purchases (seeded) and submit them exactly once; "
                                   "prints a JSON summary and exits 1 if anything stayed unacknowledged.")
    _cluster_options(p)
    p.add_argument("--client", action="append", help="client name from the config (repeatable; default: all)")
    p.add_argument("--rate", type=float, default=10_000, help="messages per second (default 10000)")
    p.add_argument("--duration", type=float, default=None, help="seconds to run (default 10)")
    p.add_argument("--messages", type=int, default=None, help="messages to send (instead of --duration)")
    p.add_argument("--overfill", type=float, default=0.2, help="share of orders overfilled (default 0.2)")
    p.add_argument("--resume", action="store_true",
                   help="a restart with the same options: read the stream up to its head and go on after the last "
                        "trade of each client found there (each client seq is regenerated as the same trade)")
    p.add_argument("--interface", default=None, help="this host's multicast interface, an address or a name "
                   "(default: the client's interface in the config)")
    p.set_defaults(func=_load)


def _add_tail(sub) -> None:
    p = sub.add_parser("tail", help="print the public stream", description="Join the public stream, fill gaps from "
                       "the rewinders and print each message as JSON, or rates with --stats.")
    _cluster_options(p)
    p.add_argument("--stats", action="store_true", help="print rates, lag and gaps each second instead of messages")
    p.add_argument("--summary", action="store_true", help="print only a JSON summary (count, digest) at the end")
    p.add_argument("--until", type=int, default=None, help="stop after delivering this seq")
    p.add_argument("--idle-exit", type=float, default=None, help="stop after this many seconds with nothing new")
    p.add_argument("--interface", default=None, help="this host's multicast interface, an address or a name "
                   "(default: the config's [stream] interface, else loopback)")
    p.set_defaults(func=_tail)


def _add_onramp(sub) -> None:
    p = sub.add_parser("onramp", help="submit trades from JSON lines",
                       description="Read trades in the challenge's JSON-lines shape from FILE (or - for stdin), "
                                   "report malformed lines with their number, submit the rest exactly once.")
    _cluster_options(p, drop=False)
    p.add_argument("file", nargs="?", default="-", help="JSON-lines file (default: stdin)")
    p.add_argument("--client", default=None, help="client name from the config (default: the first)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for acknowledgement (default 30)")
    p.set_defaults(func=_onramp)


def _add_scraper_tls(p, when: str) -> None:
    """--ca-file, --cert-file, --key-file: what a scraper of TLS metrics endpoints presents."""
    for flag, what in (("--ca-file", "the CA of the nodes' metrics certificates"),
                       ("--cert-file", "the scraper's own certificate, where the nodes ask for one"),
                       ("--key-file", "its key")):
        p.add_argument(flag, default=None, metavar="FILE", help=f"{when}: {what}")


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print a cluster config, or check one on this host",
                       description="Print a cluster config as TOML, to copy and edit: the default topology on "
                       "loopback, or with --hosts spread over a LAN (one file for every host). `tape config check "
                       "FILE` validates a config and, for the nodes that live on this host, that their addresses "
                       "and multicast interfaces exist here (exit 2 if not). `tape config units FILE` prints the "
                       "systemd unit of each node that lives here, to enable. `tape config prometheus FILE` prints "
                       "the Prometheus scrape config for that cluster (every node's metrics port, labelled with its "
                       "node and role, as ops/prometheus/tape-alerts.yml expects).")
    p.add_argument("action", nargs="?", choices=["check", "units", "prometheus", "keys"],
                   help="check FILE, or print the systemd units of its nodes on this host, or its Prometheus "
                   "scrape config, or (keys) every key a config may hold with its default and meaning, "
                   "instead of printing a config")
    p.add_argument("file", nargs="?", help="the config to check or to scrape")
    p.add_argument("--node", default=None, help="check: the node to check here (default: every node whose host is "
                   "one of this host's addresses)")
    p.add_argument("--hosts", default=None, help="a LAN: comma-separated host addresses, one a voter, then the "
                   "replicas (each on a host of its own while there are hosts), emitter and clients round robin "
                   "from the host after the voters' (each address is also that node's multicast interface; edit "
                   "interface to a name like eth0 if you prefer)")
    p.add_argument("--out", default=None, help="with --hosts: write one file a host into this directory, each "
                   "with only the keys its nodes need (0600), and prometheus.yml; print what went where")
    p.add_argument("--data", default="data", help="directory for the nodes' data (default data)")
    p.add_argument("--sequencers", type=int, default=2, help="number of sequencers (default 2)")
    p.add_argument("--replicas", type=int, default=3, help="number of replicas, with an emitter (default 3)")
    p.add_argument("--rewinders", type=int, default=2, help="number of rewinders (default 2)")
    p.add_argument("--clients", type=int, default=2, help="number of clients (default 2)")
    p.add_argument(
        "--free-ports", action="store_true", help="pick free ports and a random group instead of the fixed ones"
    )
    p.add_argument("--keys", default=None, metavar="FILE",
                   help="take the cluster's keys from FILE (JSON: stream, cluster, clients), made there owner-only "
                   "if it does not exist: keep it on the build machine, to write the host files again (a new "
                   "node, a rotation: docs/security.md)")
    _add_scraper_tls(p, "prometheus, where the config has [metrics] certfile (paths on the Prometheus host)")
    p.add_argument("--no-keys", action="store_true",
                   help="leave every link unauthenticated (default: fresh random keys; docs/security.md)")
    p.set_defaults(func=_config_default)


def _add_clock(parser) -> None:
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time one-core measurements by the wall clock (default) or by this process's CPU "
                             "time, for a busy host: what the code costs, not what the host gives")


def _add_bench_roles(bsub) -> None:
    """Each role's benchmark: its work on one core, and with --endpoint its process as it runs."""
    bs = bsub.add_parser("stream", help="sequencer alone, then the local cluster at several rates",
                         description="Messages/s of the sequencer's work alone on one core (a loop over its core, "
                                     "journal and sends), with --endpoint also of the sequencer process as it runs; "
                                     "then achieved rate and submit-to-sequenced latency of sequencer + 2 rewinders + "
                                     "load on loopback.")
    bs.add_argument("--rates", default="25000,50000,100000,150000", help="comma-separated target rates")
    bs.add_argument("--seconds", type=float, default=5.0, help="seconds per rate (default 5)")
    bs.add_argument("--sequencer-only", action="store_true", help="only the single-core sequencer measurement")
    bs.add_argument("--standby", action="store_true", help="run a standby sequencer too (4 voters, majority 3)")
    bs.add_argument("--messages", type=int, default=1_000_000, help="messages of each single-core measurement "
                    "(default 1000000)")
    bs.add_argument("--endpoint", action="store_true", help="also time the real sequencer process on one core, "
                    "leading alone (with keys, fsync a batch), its client and listener on the other core")
    _add_clock(bs)
    bs.set_defaults(func=_bench_stream)
    br = bsub.add_parser("replica", help="decode + apply rate of one replica on one core",
                         description="Decode a pre-built committed stream from memory and apply it to the audit "
                                     "state machine; prints msg/s, alerts and the digest; then times an LMDB snapshot "
                                     "of --open-orders open books (save, size, load, incremental).")
    br.add_argument("--messages", type=int, default=1_000_000, help="messages (default 1000000)")
    br.add_argument("--open-orders", type=int, default=1_000_000, help="open books to snapshot (default 1000000)")
    br.add_argument("--endpoint", action="store_true", help="also time the replica process as it runs on one core "
                    "(seal checks, ordering, audit, alert link, snapshots), a leader publishing a sealed stream and "
                    "the emitter on the other core")
    _add_clock(br)
    br.set_defaults(func=_bench_replica)
    bw = bsub.add_parser("rewinder", help="journal-and-acknowledge rate of one follower on one core",
                         description="Feed pre-built authenticated append frames through what a rewinder runs: open "
                                     "the record, decode, VoterCore, journal (fsync per append by default), seal "
                                     "the ack. Prints msg/s. With --endpoint, also the rewinder's replication "
                                     "endpoint as it runs (over TCP, on one core, a leader process on the other "
                                     "sending every append at once): msg/s, CPU a message and fsyncs.")
    bw.add_argument("--endpoint", action="store_true", help="also time the real endpoint over TCP (above)")
    bw.add_argument("--messages", type=int, default=1_000_000, help="messages (default 1000000)")
    bw.add_argument("--batch", type=int, default=500, help="messages per append frame (default 500)")
    bw.add_argument("--fsync", default="batch", help="journal fsync policy: batch, never or milliseconds "
                    "(default batch)")
    _add_clock(bw)
    bw.set_defaults(func=_bench_rewinder)


def _add_run_length(p, rate: float) -> None:
    p.add_argument("--rate", type=float, default=rate, help=f"trades per second (default {rate:.0f})")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load a run (default 15)")


def _add_pairs(p) -> None:
    p.add_argument("--pairs", type=int, default=1, help="sittings of both runs, alternated; the ratio is of "
                   "their median p99s (default 1)")


def _add_bench_security(bsub) -> None:
    """What authentication and the endpoints' bounds cost: links, metrics-flood."""
    bl = bsub.add_parser("links", help="what authenticating the links and the stream costs, each way we could",
                         description="CPU per message, on one core, of a leader writing append frames to three "
                                     "followers through Tape's link records and through TLS 1.3 (mutual, a P-256 "
                                     "certificate per node, ssl over memory BIOs), and of a stream packet's "
                                     "authentication: the keyed-hash seal of today and an Ed25519 signature "
                                     "(openssl speed); with the cores each takes at --rate.")
    bl.add_argument("--rate", type=float, default=250_000, help="messages a second the cores are given for "
                    "(default 250000)")
    bl.add_argument("--batch", type=int, default=500, help="messages an append frame (default 500)")
    bl.add_argument("--batches", type=int, default=2000, help="append frames timed (default 2000)")
    bl.add_argument("--packets", type=int, default=5000, help="stream packets timed at each size (default 5000)")
    bl.set_defaults(func=_bench_links)
    bm = bsub.add_parser("metrics-flood", help="a stranger flooding the leader's metrics endpoint, against a control",
                         description="Two tape up runs: a flooder (8 scrapers as fast as they go, up to 256 "
                                     "silent connections held) at a stand-in metrics endpoint outside the "
                                     "cluster, then at the leader's; prints each run's terms and inbound-to-applied "
                                     "p50/p99, their ratio, and what the leader's endpoint refused.")
    _add_run_length(bm, 20_000)
    _add_pairs(bm)
    bm.set_defaults(func=_bench_metrics_flood)
    br = bsub.add_parser("replays", help="many readers replaying from seq 1 at a rewinder, against a quiet run",
                         description="Two tape up runs: quiet, then with --sessions readers logged in to rw-1's "
                                     "replay port from seq 1 for the whole load (reading all they get, "
                                     "heartbeating, at nice 19: on a LAN they are other hosts); prints each run's "
                                     "terms and inbound-to-applied p50/p99, the ratio of the p99s, the messages "
                                     "replayed and the chunks the replay budget held back.")
    _add_run_length(br, 100_000)
    br.add_argument("--sessions", type=int, default=64, help="replay sessions (default 64)")
    _add_pairs(br)
    br.set_defaults(func=_bench_replays)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="measure throughput", description="Benchmarks (figures, not pass/fail).")
    bsub = bench.add_subparsers(dest="bench_command", metavar="TARGET", required=True)
    bp = bsub.add_parser("protocol", help="encode, decode and journal-append rates on one core",
                         description="Messages/s for packing, decoding and journaling trade messages.")
    bp.add_argument("--messages", type=int, default=1_000_000, help="messages per measurement (default 1000000)")
    bp.add_argument("--batch", type=int, default=1000, help="messages per journal append (default 1000)")
    _add_clock(bp)
    bp.set_defaults(func=_bench_protocol)
    _add_bench_roles(bsub)
    bf = bsub.add_parser("failover", help="failover time over repeated kill-leader drills",
                         description="Run --runs kill-leader drills and report the failover time (the old leader's "
                                     "last stamp to the new leader's term start): p50, min and max.")
    bf.add_argument("--runs", type=int, default=20, help="drills (default 20)")
    bf.add_argument("--rate", type=float, default=20_000, help="trades per second during each drill (default 20000)")
    bf.add_argument("--duration", type=float, default=4.0, help="seconds of load per drill (default 4)")
    bf.set_defaults(func=_bench_failover)
    bc = bsub.add_parser("cluster", help="marginal CPU per message of every process of tape up, over a ladder of rates",
                         description="For each rate, run the whole tape up topology for --short and --long seconds; "
                                     "print per process the CPU µs per message (the long run's CPU minus the short "
                                     "one's, over the extra messages, read from /proc), the time all of them waited "
                                     "for a core and how often they were put on one, a 1,000 messages (the same "
                                     "way, from /proc/PID/task/*/schedstat; per process in --out), the achieved "
                                     "rate and the latency percentiles, and the host's speed "
                                     "before and after (tape bench protocol's encode rate). A run whose verdict "
                                     "fails keeps its files "
                                     "(a temporary directory, named with the failed checks).")
    bc.add_argument("--rates", default="50000,100000,150000,200000,250000,300000", help="comma-separated offered rates")
    bc.add_argument("--short", type=float, default=2.0, help="seconds of the short run (default 2)")
    bc.add_argument("--long", type=float, default=8.0, help="seconds of the long run (default 8)")
    bc.add_argument("--out", default=None, help="write the figures as JSON to this file")
    _add_max_packet(bc)
    _add_durability(bc)
    bc.set_defaults(func=_bench_cluster)
    bd = bsub.add_parser("disk", help="how long a journal append waits for the disk, journals flushing at once",
                         description="Start --writers processes at once, each appending to its own journal (the real "
                                     "Journal, fsync per append) --appends times, --messages sequenced messages an "
                                     "append, one every --every-ms: a one-host cluster's voters flushing each batch "
                                     "together. Prints the append's (write and fdatasync) p50, p90, p99 and max: a "
                                     "floor under the stream's latency tail. Run it on the journals' disk (--dir).")
    bd.add_argument("--writers", type=int, default=4, help="journals flushing at once (default 4: the voters of a "
                    "one-host cluster; 1 for a voter with a disk of its own)")
    bd.add_argument("--appends", type=int, default=500, help="appends per writer (default 500)")
    bd.add_argument("--messages", type=int, default=3000, help="messages an append (default 3000: a paced batch "
                    "at 250,000 msg/s)")
    bd.add_argument("--every-ms", type=float, default=12.0, help="ms from one append's start to the next "
                    "(default 12: ~80 batches a second)")
    bd.add_argument("--dir", default=None, help="where to write (default the system's temporary directory)")
    bd.set_defaults(func=_bench_disk)
    _add_bench_batch_cost(bsub)
    _add_bench_security(bsub)
    bk = bsub.add_parser("spark", help="audit and analytics time over a generated journal",
                         description="Write a journal of --messages generated trades and its delivered alerts, then "
                                     "time in Spark: a count, the Parquet export, the audit (zero findings asserted) "
                                     "and the analytics, each with the Python reader and with Parquet; rows/s.")
    bk.add_argument("--messages", type=int, default=10_000_000, help="messages (default 10000000)")
    bk.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    bk.add_argument("--keep", default=None, help="keep (and reuse) the journal, alerts and Parquet in this directory")
    bk.set_defaults(func=_bench_spark)
    bs = bsub.add_parser("spark-stream", help="the streaming source's rate, and its lag behind a live run",
                         description="Records a second the tape streaming source delivers to Spark from a generated "
                                     "journal, beside the batch source's; then a live tape up at --rate followed by "
                                     "a streaming query over rw-1's journal: each row's lag from its sequencer stamp "
                                     "to its micro-batch's Parquet file written, p50/p99/max.")
    bs.add_argument("--messages", type=int, default=2_000_000, help="messages of the generated journal (default "
                    "2000000)")
    _add_run_length(bs, 25_000)
    bs.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    bs.set_defaults(func=_bench_spark_stream)


class _Version(argparse.Action):
    """`tape --version`: the version, and whether the C speed-ups were built (an install without a
    C compiler runs the same functions in Python, slower)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        from tape.protocol.extensions import COMPILED, missing

        gone = missing()
        speedups = "on" if not gone else f"off for {len(gone)} of {len(COMPILED)} ({', '.join(gone)})"
        print(f"tape {version('tape')} (Python {sys.version.split()[0]}; C speed-ups {speedups})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tape",
        description="Tape: a sequenced, total-order trade log with replicated state machines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.add_argument("--version", action=_Version, nargs=0, help="the version, and whether the C speed-ups are on")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_journal(sub)
    _add_sequencer(sub)
    _add_rewinder(sub)
    _add_replica(sub)
    _add_emitter(sub)
    _add_up(sub)
    _add_sim(sub)
    _add_drill(sub)
    _add_status(sub)
    _add_audit(sub)
    _add_analytics(sub)
    _add_watch(sub)
    _add_replay(sub)
    _add_node(sub)
    _add_load(sub)
    _add_tail(sub)
    _add_onramp(sub)
    _add_config(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from tape.runtime.interfaces import InterfaceError

    try:
        return args.func(args) or 0
    except InterfaceError as e:  # an interface not up yet at boot, or a config for another host: retried
        logging.getLogger("tape").error("%s (exit %d: tried again)", e, EXIT_NOT_HERE)
        return EXIT_NOT_HERE
    except ModuleNotFoundError as e:
        if e.name not in EXTRA_OF:
            raise
        print(f"tape {args.command}: needs {e.name}, of the {EXTRA_OF[e.name]} extra: "
              f"pip install 'tape[{EXTRA_OF[e.name]}]' (with -c constraints.txt)", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
