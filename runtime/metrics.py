"""Prometheus metrics without hot-path cost: processes keep plain numbers and
a function that reports them; a custom Collector reads it at scrape time."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tape.runtime import metrics_server

# A sample: (name, kind "counter" | "gauge", help, value or {label value: value}, label name), or
# (name, "histogram", help, a node.latency.LatencyHistogram)
Sample = tuple


class FunctionCollector(Collector):
    def __init__(self, prefix: str, node: str, report: Callable[[], Iterable[Sample]]):
        self.prefix = prefix
        self.node = node
        self.report = report

    def collect(self):
        for sample in self.report():
            name, kind, doc, value = sample[:4]
            if kind == "histogram":
                m = HistogramMetricFamily(f"{self.prefix}_{name}", doc, labels=["node"])
                m.add_metric([self.node], value.buckets(), value.sum_seconds)
                yield m
                continue
            label = sample[4] if len(sample) > 4 else "reason"
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            if isinstance(value, dict):
                m = family(f"{self.prefix}_{name}", doc, labels=["node", label])
                for key in sorted(value):
                    m.add_metric([self.node, str(key)], value[key])
            else:
                m = family(f"{self.prefix}_{name}", doc, labels=["node"])
                m.add_metric([self.node], value)
            yield m


def serve(port: int, prefix: str, node: str, report: Callable[[], Iterable[Sample]], host: str = "127.0.0.1",
          tls=None) -> None:
    """Expose `report` on http://host:port/metrics (port 0: not at all; https with `tls`, an
    ssl.SSLContext), bounded (runtime/metrics_server.py)."""
    REGISTRY.register(FunctionCollector(prefix, node, report))
    if port:
        server = metrics_server.start(host, port, tls=tls)
        REGISTRY.register(FunctionCollector(prefix, node, lambda: [
            ("metrics_refused", "counter", "metrics requests refused: too many at once (busy) or a second "
             "(rate_limited), or at the TLS handshake (tls)", server.refused)]))
