import platform
import subprocess
import sys

import pytest

# A link's read as a follower's transport makes it: recv() of up to 1 MiB into a new buffer,
# shrunk to what came, a few of them alive at once. Prints the page faults it took.
READS = """
import resource, socket, sys
from tape.runtime.memory import keep_heap
if sys.argv[1] == "keep":
    assert keep_heap()
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
chunk, alive = b"r" * 150_000, []
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(300):
    a.sendall(chunk)
    alive = [*alive[-2:], b.recv(1 << 20)]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_reads(how: str) -> int:
    out = subprocess.run([sys.executable, "-c", READS, how], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.process
def test_a_kept_heap_reuses_large_buffers_instead_of_faulting_them_in_again():
    """With glibc's defaults each read's buffer is mapped fresh (every page faulted in again:
    300 reads of 150 KB, ~11,000 faults); with the heap kept they come warm from it."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the thresholds are glibc's")
    fresh, kept = faults_of_reads("default"), faults_of_reads("keep")
    assert fresh > 300 * 20 and kept * 5 < fresh, (fresh, kept)
