"""The `tape` command line. Subcommands import their modules lazily so that
`tape --help` and argument errors answer at once."""

from __future__ import annotations

import argparse
import logging
import sys


def _journal_dump(args) -> int:
    from tape.ops.journal_tool import dump

    return dump(args.path, args.from_seq, args.to_seq, args.format, sys.stdout)


def _journal_verify(args) -> int:
    from tape.ops.journal_tool import verify

    return verify(args.path, sys.stdout)


def _bench_protocol(args) -> int:
    from tape.ops.bench import bench_protocol

    bench_protocol(args.messages, args.batch)
    return 0


def _demo(args) -> int:
    from tape.ops.demo import run_demo

    return run_demo(args.messages, args.out, args.drop, args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tape",
        description="Tape: a sequenced, total-order trade log with replicated state machines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="run the end-to-end demo on loopback multicast",
                          description="Stamp trades, journal them, publish them as MoldUDP64 over loopback "
                                      "multicast, receive and check them, and dump the journal.")
    demo.add_argument("--messages", type=int, default=200_000, help="trades to send (default 200000)")
    demo.add_argument("--out", default=None, help="directory to keep the journal in (default: a temporary one)")
    demo.add_argument("--drop", type=float, default=0.0, help="fraction of datagrams the receiver drops (default 0)")
    demo.add_argument("--seed", type=int, default=1, help="seed of the trade generator and loss injection")
    demo.set_defaults(func=_demo)

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

    bench = sub.add_parser("bench", help="measure throughput", description="Benchmarks (figures, not pass/fail).")
    bsub = bench.add_subparsers(dest="bench_command", metavar="TARGET", required=True)
    bp = bsub.add_parser("protocol", help="encode, decode and journal-append rates on one core",
                         description="Messages/s for packing, decoding and journaling trade messages.")
    bp.add_argument("--messages", type=int, default=1_000_000, help="messages per measurement (default 1000000)")
    bp.add_argument("--batch", type=int, default=1000, help="messages per journal append (default 1000)")
    bp.set_defaults(func=_bench_protocol)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
