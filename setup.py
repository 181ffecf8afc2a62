"""The one thing pyproject.toml cannot say stably: the journal's record encoding in C (the
voters' hottest loop). Optional: without a compiler the build skips it and
protocol/journal.py uses the same function in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tape.protocol._speedups", sources=["protocol/_speedups.c"], optional=True)])
