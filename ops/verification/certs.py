"""Certificates as an operator's openssl makes them, for the benches and tests of what TLS costs and
refuses: a CA, and a P-256 certificate it signs for each name (with an IP address, a server's)."""

from __future__ import annotations

import subprocess
from pathlib import Path

DAYS = "2"  # they live as long as a test or a bench


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def make_certificates(directory: Path, names: list[str], ip: str | None = None, ca: str = "ca") -> None:
    """`ca.pem`/`ca.key` (made if absent) and `NAME.pem`/`NAME.key` for each name, CN=NAME, and with
    `ip` a subjectAltName of it, which a client such as Prometheus checks the server's address by."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    if not (directory / f"{ca}.pem").exists():
        _openssl(directory, "req", "-x509", *key, "-days", DAYS, "-subj", f"/CN=tape-{ca}", "-keyout", f"{ca}.key",
                 "-out", f"{ca}.pem")
    for name in names:
        san = ("-addext", f"subjectAltName=IP:{ip}") if ip else ()
        _openssl(directory, "req", *key, "-subj", f"/CN={name}", *san, "-keyout", f"{name}.key", "-out", f"{name}.csr")
        _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-copy_extensions", "copy", "-days", DAYS, "-out", f"{name}.pem")
