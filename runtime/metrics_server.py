"""A node's metrics endpoint, bounded (issue 63): anyone who reaches it may connect, so it must
not let them take the process's threads, its file descriptors or the GIL its event loop needs.

prometheus-client's own server starts a thread for every connection and waits on a silent one
for ever. This one, on the same WSGI app: at most METRICS_ACCEPTS_PER_S connections a second
are given a thread, and METRICS_CONNECTIONS requests at once (the rest are closed at once,
unread: a thread and its HTTP parsing under the GIL cost the event loop more than a 429 saves);
a request not read whole within METRICS_READ_TIMEOUT_S is dropped (one request a connection,
HTTP/1.0: no idle keep-alive); and at most METRICS_SCRAPES_PER_S answers a second (a burst of
as many), each further one a 429 that costs no collection, since a
collection walks every metric under the GIL. With TLS (`[metrics]`), each connection's handshake
runs in its own thread within the read timeout, so a silent or failing one holds one slot a
while and never the accepting thread; a scraper without the client certificate asked for is
refused there, and at most METRICS_HANDSHAKES_PER_S are begun a second (rate_limited beyond).
Counted in `refused` by reason."""

from __future__ import annotations

import socketserver
import ssl
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import REGISTRY, make_wsgi_app

from tape.protocol.budgets import TokenBucket
from tape.runtime.tuning import (
    METRICS_ACCEPTS_PER_S,
    METRICS_CONNECTIONS,
    METRICS_HANDSHAKES_PER_S,
    METRICS_READ_TIMEOUT_S,
    METRICS_SCRAPES_PER_S,
)


class _Handler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_S  # the socket's: a slow or silent client is dropped

    def setup(self) -> None:
        super().setup()  # (the timeout set: it bounds the handshake too)
        if isinstance(self.connection, ssl.SSLSocket):
            if not self.server.handshakes.take():  # a handshake costs the host more than a 429 does
                self.server.refused["rate_limited"] += 1
                raise ConnectionAbortedError("too many TLS handshakes")
            try:
                self.connection.do_handshake()
            except (OSError, ValueError):  # ssl.SSLError is an OSError: no TLS, no certificate, a bad one
                self.server.refused["tls"] += 1
                raise

    def log_message(self, *args) -> None:
        pass  # (counted instead: a flood must not become a flood of log lines)


class _SharedBucket:
    """A TokenBucket of `rate` a second (a burst of as many) that the request threads share."""

    def __init__(self, rate: float, clock):
        self.clock, self.bucket, self.lock = clock, TokenBucket(rate, rate, clock()), threading.Lock()

    def take(self) -> bool:
        with self.lock:
            return self.bucket.take(self.clock())


class MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, clock=time.monotonic, tls: ssl.SSLContext | None = None):
        super().__init__((host, port), _Handler)
        if tls is not None:  # the handshake in the request's thread (_Handler.setup), not in accept()
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.clock = clock
        self.slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        self.refused = {"busy": 0, "rate_limited": 0, "tls": 0}
        now = lambda: self.clock()  # noqa: E731 (read when taken: a test moves it)
        self.accepts = _SharedBucket(METRICS_ACCEPTS_PER_S, now)
        self.scrapes = _SharedBucket(METRICS_SCRAPES_PER_S, now)
        self.handshakes = _SharedBucket(METRICS_HANDSHAKES_PER_S, now)
        collect = make_wsgi_app(REGISTRY)

        def app(environ, start_response):
            if not self.scrapes.take():
                self.refused["rate_limited"] += 1
                start_response("429 Too Many Requests", [("Content-Type", "text/plain"), ("Retry-After", "1")])
                return [b"too many scrapes\n"]
            return collect(environ, start_response)

        self.set_app(app)

    def process_request(self, request, client_address) -> None:
        if not self.accepts.take():  # no thread, no read: a flood of connections costs accept() and close()
            self.refused["rate_limited"] += 1
            self.shutdown_request(request)
            return
        if not self.slots.acquire(blocking=False):
            self.refused["busy"] += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away or timed out: nothing to report


def start(host: str, port: int, clock=time.monotonic, tls: ssl.SSLContext | None = None) -> MetricsServer:
    """Serve the registry on http://host:port/metrics (https with `tls`) from a thread of its own."""
    server = MetricsServer(host, port, clock, tls)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
