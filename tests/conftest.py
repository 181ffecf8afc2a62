import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

TAPE = [sys.executable, "-m", "tape.ops.cli"]  # the real CLI, in this venv



@pytest.fixture(scope="session")
def spark():
    """One local Spark session for every Spark test (start-up costs seconds)."""
    from tape.ops.spark import session

    s = session("local[2]", "tape-tests")
    yield s
    s.stop()
