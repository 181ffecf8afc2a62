"""`tape analytics`: what a journal says about the trading it holds.

Computed in Spark from the journal (or its Parquet export): volumes per stock
and per client, fill ratios and the overfill distribution per order (by the
replicas' rules, as Spark SQL windows: `tape.ops.spark.source.apply_rules`), rejects and
orphans by reason, the message rate per second and the gaps between
successive sequencer stamps. Printed as tables; written to DIR as
`analytics.json`, PNG plots and an `index.html` that shows them all.

Inbound-to-sequenced latency needs the client's send time, which inbound
messages do not carry; the report says so rather than guess (`tape up`
measures submit-to-sequenced and inbound-to-applied live).
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tape.ops.spark.live import DEFAULT_WINDOW, volume_windows, volumes

FILL_BUCKETS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0000001, 1.25, 1.5, 2.0, float("inf")]
FILL_LABELS = ["0-25%", "25-50%", "50-75%", "75-<100%", "100% (exact)", "100-125%", "125-150%", "150-200%", ">200%"]


def compute(spark, journal: str, book_ttl_ns: int, orphan_ttl_ns: int, skip_corrupt: bool = False,
            progress=None, windows_out: str | None = None, window: str = DEFAULT_WINDOW) -> dict:
    """The report; with `windows_out`, the volume windows too, as Parquet there (`tape watch`'s)."""
    from pyspark.sql import functions as F

    from tape.ops.spark.source import journal_df

    def phase(what):
        if progress is not None:
            progress.phase(what)

    df = journal_df(spark, journal, skip_corrupt).cache()
    phase("reading the journal")
    by_type = {r["type"]: r["count"] for r in df.groupBy("type").count().collect()}
    corrupt = ([r["corrupt"] for r in df.where("type = 'corrupt'").select("corrupt").limit(20).collect()]
               if by_type.get("corrupt") else [])  # (a job saved where there is none: seconds on a cluster)
    msgs = df.where("type != 'corrupt'")
    span = msgs.agg(F.min("seq").alias("first_seq"), F.max("seq").alias("last_seq"),
                    F.min("stamp_ns").alias("first_ns"), F.max("stamp_ns").alias("last_ns")).first().asDict()
    trades = msgs.where(F.col("type").isin("purchase_request", "purchase"))
    phase("volumes per stock and client")
    per_stock, per_client = _volumes(trades, "stock"), _volumes(trades, "client")
    phase("orders by the replicas' rules")
    orders = _orders(trades, book_ttl_ns, orphan_ttl_ns, span["last_ns"] or 0)
    phase("rate per second")
    rate = [(r["second"], r["count"]) for r in msgs.groupBy(F.floor(F.col("stamp_ns") / 1e9).alias("second")).count()
            .orderBy("second").collect()]
    phase("stamp gaps")
    gaps = _stamp_gaps(msgs)
    if windows_out is not None:
        phase(f"volume windows of {window}")
        volume_windows(msgs, window).write.mode("overwrite").parquet(windows_out)
    df.unpersist()
    seconds = max(1, len(rate))
    return {
        "journal": journal,
        "messages": sum(v for k, v in by_type.items() if k != "corrupt"), "by_type": by_type,
        "corrupt_records": by_type.get("corrupt", 0), "corrupt_first": corrupt,
        "first_seq": span["first_seq"], "last_seq": span["last_seq"],
        "first_stamp_ns": span["first_ns"], "last_stamp_ns": span["last_ns"],
        "per_stock": per_stock, "per_client": per_client,
        **orders,
        "rate_per_second": {"seconds": len(rate), "mean": round(sum(c for _, c in rate) / seconds, 1),
                            "max": max((c for _, c in rate), default=0), "series": rate},
        "stamp_gaps_us": gaps,
        "latency": "not in the journal: inbound messages carry no client send time. `tape up` reports "
                   "submit-to-sequenced and inbound-to-applied percentiles measured live.",
    }


def _quantiles(row, key) -> list:
    return [round(x, 3) for x in (row[key] or [])]


def _volumes(trades, key: str) -> list[dict]:
    from pyspark.sql import functions as F

    rows = trades.groupBy(key).agg(*volumes()).orderBy(F.desc("purchased_shares"), key).collect()
    return [r.asDict() for r in rows]


def _orders(trades, book_ttl_ns: int, orphan_ttl_ns: int, end_ns: int) -> dict:
    """Books, fill ratios, overfill, rejects and alerts, by the replicas' rules."""
    from pyspark.sql import functions as F

    from tape.ops.spark.source import REJECT_REASONS, alerts_df, apply_rules

    book_rows, outcomes = apply_rules(trades, book_ttl_ns, orphan_ttl_ns, end_ns=end_ns)
    outcomes = outcomes.cache()
    filled = (outcomes.where("outcome = 'fill'").groupBy("order_id", F.col("book").alias("book_seq"))
              .agg(F.sum("shares").alias("filled")))
    books = (book_rows.join(filled, ["order_id", "book_seq"], "left")
             .select("requested", F.coalesce("filled", F.lit(0)).alias("filled"))
             .withColumn("ratio", F.col("filled") / F.col("requested")).cache())
    bucket = F.lit(len(FILL_LABELS) - 1)
    for i in reversed(range(len(FILL_LABELS))):
        in_bucket = (F.col("ratio") >= FILL_BUCKETS[i]) & (F.col("ratio") < FILL_BUCKETS[i + 1])
        bucket = F.when(in_bucket, i).otherwise(bucket)
    fill_counts = {r["b"]: r["count"] for r in books.withColumn("b", bucket).groupBy("b").count().collect()}
    fill = [{"bucket": label, "orders": fill_counts.get(i, 0)} for i, label in enumerate(FILL_LABELS)]
    summary = books.agg(F.count("*").alias("orders"), F.avg("ratio").alias("mean_fill_ratio"),
                        F.sum((F.col("filled") > F.col("requested")).cast("long")).alias("overfilled")).first()
    over = books.where("filled > requested").withColumn("over", F.col("filled") - F.col("requested"))
    ratio = F.col("over") / F.col("requested")
    quantiles = [0.5, 0.9, 0.99]
    over_q = over.agg(F.percentile_approx("over", quantiles, 1000).alias("q"), F.max("over").alias("max"),
                      F.percentile_approx(ratio, quantiles, 1000).alias("rq"), F.max(ratio).alias("rmax")).first()
    over_hist = [(r["b"], r["count"]) for r in over.withColumn("b", F.floor(ratio * 20) / 20)
                 .groupBy("b").count().orderBy("b").collect()]
    rejects = {r["outcome"]: r["count"] for r in outcomes.where(F.col("outcome").isin(*REJECT_REASONS))
               .groupBy("outcome").count().orderBy("outcome").collect()}
    alerts = alerts_df(outcomes, "").count()
    outcomes.unpersist()
    books.unpersist()
    return {
        "orders": {"books": summary["orders"], "mean_fill_ratio": round(summary["mean_fill_ratio"] or 0, 4),
                   "overfilled": summary["overfilled"], "alerts": alerts, "fill_ratio_buckets": fill},
        "overfill": {"shares_p50_p90_p99": _quantiles(over_q, "q"), "shares_max": over_q["max"],
                     "ratio_p50_p90_p99": _quantiles(over_q, "rq"), "ratio_max": over_q["rmax"],
                     "histogram_ratio_step_0_05": over_hist},
        "rejects": rejects,
    }


def _stamp_gaps(msgs) -> dict:
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    stamps = msgs.select("stamp_ns").distinct()
    gaps = (stamps.withColumn("gap_us", (F.col("stamp_ns") - F.lag("stamp_ns").over(Window.orderBy("stamp_ns"))) / 1e3)
            .where("gap_us IS NOT NULL").cache())
    row = gaps.agg(F.count("*").alias("n"), F.percentile_approx("gap_us", [0.5, 0.9, 0.99], 1000).alias("q"),
                   F.max("gap_us").alias("max")).first()
    decade = F.floor(F.log10(F.greatest(F.col("gap_us"), F.lit(1.0))))
    hist = [(r["b"], r["count"]) for r in gaps.withColumn("b", decade).groupBy("b").count().orderBy("b").collect()]
    gaps.unpersist()
    return {"count": row["n"], "p50_p90_p99": _quantiles(row, "q"), "max": row["max"], "histogram_log10_us": hist}


# --- presentation ----------------------------------------------------------------------------


def print_tables(console: Console, r: dict, top: int = 10) -> None:
    t = Table(title=f"tape analytics: {r['journal']}", show_header=False)
    t.add_column("")
    t.add_column("", justify="right")
    t.add_row("messages", f"{r['messages']:,} (seq {r['first_seq']:,}..{r['last_seq']:,})")
    for k, v in sorted(r["by_type"].items()):
        t.add_row(f"  {k}", f"{v:,}")
    o = r["orders"]
    t.add_row("order books", f"{o['books']:,}")
    t.add_row("mean fill ratio", f"{o['mean_fill_ratio']:.2%}")
    t.add_row("overfilled orders (alerts)", f"{o['overfilled']:,} ({o['alerts']:,})")
    ov = r["overfill"]
    if ov["shares_p50_p90_p99"]:
        t.add_row("overfill shares p50 / p90 / p99 / max",
                  " / ".join(f"{x:,.0f}" for x in ov["shares_p50_p90_p99"]) + f" / {ov['shares_max']:,}")
    rate = r["rate_per_second"]
    t.add_row("message rate, mean / max per second", f"{rate['mean']:,.0f} / {rate['max']:,} over {rate['seconds']} s")
    g = r["stamp_gaps_us"]
    if g["p50_p90_p99"]:
        t.add_row("stamp-to-stamp gap p50 / p90 / p99 / max",
                  " / ".join(f"{x:,.0f}" for x in g["p50_p90_p99"]) + f" / {g['max']:,.0f} µs")
    t.add_row("inbound-to-sequenced latency", "not in the journal (see report)")
    if r["corrupt_records"]:
        t.add_row("[red]corrupt records skipped[/red]", f"{r['corrupt_records']:,}")
    console.print(t)
    for key, title in (("per_stock", "stock"), ("per_client", "client")):
        vt = Table(title=f"volumes per {title} (top {top} by purchased shares of {len(r[key]):,})")
        for col in (title, "requests", "requested shares", "purchases", "purchased shares"):
            vt.add_column(col, justify="left" if col == title else "right")
        for row in r[key][:top]:
            vt.add_row(str(row[title if title == "stock" else "client"]), f"{row['requests']:,}",
                       f"{row['requested_shares']:,}", f"{row['purchases']:,}", f"{row['purchased_shares']:,}")
        console.print(vt)
    ft = Table(title="fill ratio per order book")
    ft.add_column("filled / requested")
    ft.add_column("orders", justify="right")
    for b in o["fill_ratio_buckets"]:
        ft.add_row(b["bucket"], f"{b['orders']:,}")
    console.print(ft)
    rt = Table(title="rejects and orphans by reason")
    rt.add_column("reason")
    rt.add_column("messages", justify="right")
    for reason, n in sorted(r["rejects"].items()) or [("(none)", 0)]:
        rt.add_row(reason, f"{n:,}")
    console.print(rt)


def write_plots(out: Path, r: dict) -> list[tuple[str, str]]:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []

    def save(name, title, fig):
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        plots.append((name, title))

    series = r["rate_per_second"]["series"]
    if series:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        t0 = series[0][0]
        ax.plot([s - t0 for s, _ in series], [c for _, c in series], drawstyle="steps-post")
        ax.set_xlabel("second of the session")
        ax.set_ylabel("messages / s")
        ax.grid(alpha=0.3)
        save("rate_per_second.png", "Message rate per second", fig)
    for key, label in (("per_stock", "stock"), ("per_client", "client")):
        rows = r[key][:20]
        if rows:
            fig, ax = plt.subplots(figsize=(9, 3.8))
            names = [str(x[label]) for x in rows]
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [x["requested_shares"] for x in rows], 0.4, label="requested")
            ax.bar([x + 0.2 for x in xs], [x["purchased_shares"] for x in rows], 0.4, label="purchased")
            ax.set_xticks(list(xs), names, rotation=45, ha="right")
            ax.set_ylabel("shares")
            ax.legend()
            save(f"volume_by_{label}.png", f"Volume per {label} (top {len(rows)})", fig)
    buckets = r["orders"]["fill_ratio_buckets"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar([b["bucket"] for b in buckets], [b["orders"] for b in buckets], color="tab:green")
    ax.set_ylabel("order books")
    ax.tick_params(axis="x", rotation=30)
    save("fill_ratio.png", "Fill ratio per order book (filled / requested)", fig)
    hist = r["overfill"]["histogram_ratio_step_0_05"]
    if hist:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.bar([b * 100 for b, _ in hist], [n for _, n in hist], width=4.5, align="edge", color="tab:red")
        ax.set_xlabel("overfill, % of the requested shares")
        ax.set_ylabel("order books")
        save("overfill.png", "Overfill distribution", fig)
    gh = r["stamp_gaps_us"]["histogram_log10_us"]
    if gh:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.bar([f"10^{int(b)}" for b, _ in gh], [n for _, n in gh], color="tab:purple")
        ax.set_xlabel("gap between successive stamps (µs, decade)")
        ax.set_ylabel("gaps")
        save("stamp_gaps.png", "Stamp-to-stamp gaps", fig)
    if r["rejects"]:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        items = sorted(r["rejects"].items())
        ax.barh([k for k, _ in items], [v for _, v in items], color="tab:orange")
        ax.set_xlabel("messages")
        save("rejects.png", "Rejects and orphans by reason", fig)
    return plots


def write_html(out: Path, r: dict, plots: list[tuple[str, str]]) -> Path:
    esc = html.escape

    def table(headers, rows):
        head = "".join(f"<th>{esc(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    o, g, rate = r["orders"], r["stamp_gaps_us"], r["rate_per_second"]
    summary = [("messages", f"{r['messages']:,}"), ("seq range", f"{r['first_seq']:,} .. {r['last_seq']:,}"),
               *[(f"type {k}", f"{v:,}") for k, v in sorted(r["by_type"].items())],
               ("order books", f"{o['books']:,}"), ("mean fill ratio", f"{o['mean_fill_ratio']:.2%}"),
               ("overfilled orders", f"{o['overfilled']:,}"), ("alerts", f"{o['alerts']:,}"),
               ("rate mean / max (msg/s)", f"{rate['mean']:,.0f} / {rate['max']:,}"),
               ("stamp gap p50 / p90 / p99 (µs)", " / ".join(f"{x:,.0f}" for x in g["p50_p90_p99"])),
               ("corrupt records skipped", f"{r['corrupt_records']:,}"),
               ("inbound-to-sequenced latency", r["latency"])]
    vol_cols = ("requests", "requested_shares", "purchases", "purchased_shares")
    parts = [
        f"<h1>Tape analytics</h1><p>{esc(r['journal'])}</p>",
        table(("measure", "value"), summary),
        *[f"<h2>{esc(title)}</h2><img src='{name}' alt='{esc(title)}'>" for name, title in plots],
        "<h2>Volumes per stock</h2>",
        table(("stock", *vol_cols), [(x["stock"], *(f"{x[c]:,}" for c in vol_cols)) for x in r["per_stock"]]),
        "<h2>Volumes per client</h2>",
        table(("client", *vol_cols), [(x["client"], *(f"{x[c]:,}" for c in vol_cols)) for x in r["per_client"]]),
        "<h2>Fill ratio per order book</h2>",
        table(("filled / requested", "orders"), [(b["bucket"], f"{b['orders']:,}") for b in o["fill_ratio_buckets"]]),
        "<h2>Rejects and orphans by reason</h2>",
        table(("reason", "messages"), sorted(r["rejects"].items())),
    ]
    style = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}img{max-width:100%}")
    page = out / "index.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>Tape analytics</title>"
                    f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
    return page


def run(journal: str, out: str, book_ttl_ns: int, orphan_ttl_ns: int, master: str, conf: dict,
        skip_corrupt: bool, window: str = DEFAULT_WINDOW) -> int:
    from tape.ops.spark.source import SparkProgress, session

    console = Console()
    err = Console(stderr=True)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with err.status("starting Spark…"):
        spark = session(master, "tape-analytics", conf)
    try:
        with SparkProgress(spark, err, "reading the journal") as progress:
            report = compute(spark, journal, book_ttl_ns, orphan_ttl_ns, skip_corrupt, progress,
                             str(out_dir / "windows"), window)
    finally:
        spark.stop()
    report["seconds"] = round(time.monotonic() - t0, 1)
    print_tables(console, report)
    plots = write_plots(out_dir, report)
    (out_dir / "analytics.json").write_text(json.dumps(report, indent=1))
    page = write_html(out_dir, report, plots)
    console.print(f"{report['messages']:,} messages in {report['seconds']} s; report: {page}")
    return 0
