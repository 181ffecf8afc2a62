"""What pyproject.toml cannot say stably: the C extensions. Optional: without a compiler the build
skips them and the same functions run in Python (protocol/journal.py, replicas/audit_core.py, ...).
tests/build_sanitized.py builds the same list with the sanitizers (make test-sanitize)."""

from setuptools import Extension, setup

EXTENSIONS = [
    Extension("tape.protocol._speedups", sources=["protocol/_speedups.c"], depends=["protocol/_blake2b.h"],
              optional=True),
    Extension("tape.replicas._audit", sources=["replicas/_audit.c"], optional=True),
    Extension("tape.replicas._alertlines", sources=["replicas/_alertlines.c"], optional=True),
    Extension("tape.replicas._snapshot", sources=["replicas/_snapshot.c"], depends=["protocol/_blake2b.h"],
              optional=True),
    Extension("tape.runtime._mmsg", sources=["runtime/_mmsg.c"], optional=True),
]

if __name__ == "__main__":
    setup(ext_modules=EXTENSIONS)
