"""A webhook endpoint for drills: records every POST (its Idempotency-Key and body) as one JSON
line, and answers 200. A consumer dedups by the key; the drill counts both.

    python -m tape.ops.verification.webhook_receiver --host 10.0.0.6 --port 8080 --out posts.jsonl
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading


def serve(host: str, port: int, out: str) -> None:
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            line = json.dumps({"key": self.headers.get("Idempotency-Key"), "body": body.decode(errors="replace")})
            with lock, open(out, "a") as f:
                f.write(line + "\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    serve(args.host, args.port, args.out)


if __name__ == "__main__":
    main()
