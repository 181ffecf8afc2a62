import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

TAPE = [sys.executable, "-m", "tape.ops.cli.main"]  # the real CLI, in this venv


# For a Spark command's JVMs (and a standalone cluster's), which live for one small job each: compiled
# with C1 only, their warm-up is shorter (`tape audit` of 10,000 messages 44.6 -> 35.8 s, the standalone
# test 231 -> 144 s; the long-lived session of the in-process tests is faster with both compilers).
def short_lived_jvm() -> dict:
    return {**os.environ, "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1"}


def wait_for(condition, what: str, timeout: float = 30.0, every: float = 0.05):
    """Poll `condition()` until it returns something true (returned), or fail saying what was awaited
    and the last thing it returned. Tests wait for events with a deadline; they never sleep a fixed
    time and then assert."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except OSError as e:  # a process not (yet) answering its metrics
            value = e
        if value and not isinstance(value, OSError):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(every)


async def until(condition, what: str, timeout: float = 10.0, every: float = 0.005):
    """wait_for inside a test's event loop: it awaits between polls, so the loop's readers and timers run."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        await asyncio.sleep(every)
    return value


class Clock:
    """A monotonic ns clock a test moves by hand (a shell's `clock=`)."""

    def __init__(self, now: int = 10**12):
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += int(ms * 1_000_000)


def connect(port: int, what: str, timeout: float = 20.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:`port`, polled while refused: a node serves its metrics (what
    start-up waits for) before it has opened every listener."""
    sock = wait_for(lambda: _try_connect(port), f"{what} (:{port}) to accept connections", timeout)
    sock.settimeout(5)
    return sock


def _try_connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except ConnectionRefusedError:
        return None


@pytest.fixture
def lan():
    """Five hosts of network namespaces on a bridge (ops/verification/lan.py), deleted after."""
    from tape.ops.verification.lan import Lan, LanUnavailable

    if os.geteuid() != 0:
        pytest.skip("the LAN tests make network namespaces: they need root (ip netns)")
    try:
        with Lan(5) as made:
            yield made
    except LanUnavailable as e:
        pytest.skip(f"network namespaces are not available here: {e}")


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for every Spark test (start-up costs seconds)."""
    from tape.ops.spark.source import session

    s = session("local[2]", "tape-tests")
    yield s
    s.stop()


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the test (root only); yields the filler's path."""
    from tape.ops.verification.faults import mount_tmpfs

    if not AS_ROOT:
        pytest.skip("needs root: a small file system is a tmpfs mounted for the test")
    mount_tmpfs(path, size)  # (as root a mount that fails is a failure, not a skip)
    try:
        yield path / "filler"
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A real `tape up` run: journals, alerts.jsonl, replicas' status (read only: one for every module)."""
    out = tmp_path_factory.mktemp("up")
    done = subprocess.run(TAPE + ["up", "--rate", "5000", "--duration", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


FAST_TIER = os.environ.get("TAPE_TEST_TIER") == "fast"  # set by `make test-fast`
AS_ROOT = os.geteuid() == 0
# What a test needs root for (namespaces, mounts): without it the test skips, saying so; as root
# nothing may skip (pytest_sessionfinish below), so that CI, which runs as root, runs every test.
needs_root = pytest.mark.skipif(not AS_ROOT, reason="needs root (network namespaces, a tmpfs mount)")


@pytest.fixture(scope="session")
def _font_cache():
    """matplotlib asks fc-list once a machine, when it first builds its font cache: that is the
    machine's set-up, not a test starting a process, so it happens before the guard below."""
    if FAST_TIER:
        with contextlib.suppress(ImportError):
            import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(monkeypatch, _font_cache):
    """In the fast tier no test starts a process: one that tries is missing its `process` marker."""
    if not FAST_TIER:
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a test of the fast tier started a process: mark it `process` (pyproject.toml)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", refuse)


@pytest.fixture(autouse=True)
def _clean_node_logs(request, monkeypatch):
    """Every cluster a test starts (ops/verification/local.py LocalCluster) leaves logs with no
    Traceback and no CRITICAL line but those the test planted: `cluster.planted = (pattern, ...)`."""
    if "process" not in request.keywords:
        yield
        return
    from tape.ops.verification import local
    from tape.ops.verification.verdict import log_problems

    clusters = []
    original = local.LocalCluster.__init__

    def register(self, *args, **kwargs):
        original(self, *args, **kwargs)
        clusters.append(self)

    monkeypatch.setattr(local.LocalCluster, "__init__", register)
    yield
    problems = {name: lines for c in clusters for name, path in c.logs.items() if path.exists()
                and (lines := log_problems(path.read_text(errors="replace"), c.planted))}
    assert not problems, f"unexpected lines in the nodes' logs (plant them if the test caused them): {problems}"


def pytest_configure(config):
    """Under make test-sanitize, every C extension must be the sanitized build, never the usual one."""
    sanitized = os.environ.get("TAPE_SANITIZED")
    if sanitized:
        import importlib

        from tape.protocol.extensions import COMPILED

        root = str(Path(sanitized).resolve())
        wrong = [n for n in sorted(COMPILED) if not importlib.import_module(n).__file__.startswith(root)]
        assert not wrong, f"not the sanitized build under {root}: {wrong}"


_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(f"{report.nodeid}: {report.longrepr[2] if isinstance(report.longrepr, tuple) else ''}")


def pytest_sessionfinish(session, exitstatus):
    """As root, with the C extensions in place, a skipped test fails the run: every test can run there."""
    from tape.protocol.extensions import PURE

    if AS_ROOT and not PURE and _skipped and exitstatus == 0:
        print(f"\nas root nothing may skip, and {len(_skipped)} tests did:\n  " + "\n  ".join(_skipped[:20]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
