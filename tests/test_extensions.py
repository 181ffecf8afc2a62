"""TAPE_PURE=1 (protocol/extensions.py): every C extension hidden, each part on its Python twin."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from compilers import where_built

from tape.protocol import extensions

ROOT = Path(__file__).resolve().parent.parent
LOADED = ("import sys, tape.ops.cli.main, tape.ops.verification.sim, tape.replicas.replica_shell, tape.replicas.sinks\n"
          "import tape.runtime.mmsg\n"
          "from tape.replicas.audit_core import AuditMachine\n"
          "print(sorted(m for m in sys.modules if m.rsplit('.', 1)[-1].startswith('_') and m.startswith('tape.')),"
          " AuditMachine().compiled)")


def test_the_switch_names_every_extension_setup_builds_and_hides_only_those():
    built = re.findall(r'Extension\("([\w.]+)"', (ROOT / "setup.py").read_text())
    assert sorted(built) == sorted(extensions.COMPILED)
    finder = extensions._HideCompiled()
    for name in built:
        with pytest.raises(ImportError, match="TAPE_PURE"):
            finder.find_spec(name)
    assert finder.find_spec("tape.protocol.journal") is None


def loaded(pure: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TAPE_PURE"} | ({"TAPE_PURE": "1"} if pure else {})
    return subprocess.run([sys.executable, "-c", LOADED], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


@pytest.mark.process
def test_a_process_under_the_switch_loads_no_extension():
    assert loaded(pure=True) == "[] False"


@pytest.mark.process
@where_built
def test_a_process_without_it_loads_every_extension_built():
    assert loaded(pure=False) == f"{sorted(extensions.COMPILED)} True"
