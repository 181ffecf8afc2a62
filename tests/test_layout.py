"""The card's layout holds: imports go ops -> roles -> node -> protocol, never
back; roles do not import each other; the pure layer does no I/O."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"protocol": 0, "node": 1, "sequencer": 2, "rewinder": 2, "replicas": 2, "ops": 3}
# What a sans-I/O module may not touch: sockets, files, processes, the clock, randomness.
IO_MODULES = {"asyncio", "socket", "os", "time", "random", "lmdb", "pathlib", "subprocess", "threading", "io",
              "shutil", "tempfile", "selectors", "signal", "datetime"}


# The pure modules of the roles (every module of protocol/ is pure): their cores.
PURE_IN_ROLES = {"sequencer/core.py", "sequencer/followers.py", "sequencer/client_core.py", "sequencer/node.py",
                 "sequencer/client_node.py",
                 "rewinder/gapfill.py",
                 "rewinder/node.py", "replicas/audit.py", "replicas/replica_core.py", "replicas/emitter_core.py",
                 "replicas/emitter_node.py", "replicas/replica_node.py"}
# A process's node core: every decision of that process. The shell and the simulator drive it, and
# only it, of the cores it combines.
NODE_CORES = {"EmitterNode", "VoterNode", "RewinderNode", "ReplicaNode", "SequencerNode", "ClientNode"}
SHELLS = ["node/voter.py", "node/listener.py", "sequencer/server.py", "sequencer/client.py", "rewinder/server.py",
          "replicas/runtime.py", "replicas/emitter.py"]
# Cores that a shell and the simulator both still drive, each with the glue around it written twice
# (issue 59): every role has its node core now, and this list stays empty.
NOT_YET_NODE_CORES: set[str] = set()
VALUES = {"PacketBuilder", "FrameReader", "Reader", "LeaderSettings",  # codecs and settings: both may build them
          "AuditMachine"}  # the replica's state, as its shell loads it from the disk (fresh when there is none)


def imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions count; a relative
    import as the absolute name it stands for)."""
    out = []
    package = f"tape.{path.parent.name}"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.ImportFrom):  # (the folders are one level deep: `..` is tape)
            base = package if node.level == 1 else "tape"
            out += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
    return out


# protocol/'s one module that is not a core: it reads the environment once, at import, to choose
# which implementation loads (TAPE_PURE=1 hides the C extensions).
NOT_PURE_IN_PROTOCOL = {"extensions.py", "__init__.py"}


def is_pure(folder: str, path: Path) -> bool:
    return (folder == "protocol" and path.name not in NOT_PURE_IN_PROTOCOL) or f"{folder}/{path.name}" in PURE_IN_ROLES


def modules():
    for folder in LAYER:
        for path in sorted((ROOT / folder).glob("*.py")):
            yield folder, path


def violations(layer=LAYER) -> list[str]:
    found = []
    for folder, path in modules():
        for name in imports(path):
            parts = name.split(".")
            if parts[0] != "tape" or len(parts) < 2:
                continue
            target = parts[1]
            if target not in layer:
                found.append(f"{folder}/{path.name} imports unknown package {name}")
            elif target != folder and layer[target] >= layer[folder]:
                found.append(f"{folder}/{path.name} imports {name}")
    return found


def test_imports_only_go_down_the_layers():
    assert violations() == []


def test_the_check_fails_on_an_upward_import():
    # Judged with ops placed below the roles, ops' imports of the roles are violations.
    assert any(v.startswith("ops/cli.py imports tape.sequencer") for v in violations({**LAYER, "ops": 1}))


def test_no_pure_module_does_io_or_imports_one_that_may():
    """No sockets, files, processes, clock or randomness in a pure module, nor any import of a module
    of Tape's that is not pure itself."""
    pure = {f"tape.{folder}.{p.stem}" for folder, p in modules() if is_pure(folder, p)}
    bad = []
    for folder, path in modules():
        if is_pure(folder, path):
            for name in imports(path):
                top = name.split(".")[0]
                compiled = name.rsplit(".", 1)[-1].startswith("_")  # a C twin of pure functions, held equal
                if top in IO_MODULES or (top == "tape" and name not in pure and name.count(".") > 1 and not compiled):
                    bad.append(f"{folder}/{path.name} imports {name}")
    assert bad == []


def test_the_purity_check_sees_relative_imports(tmp_path):
    (tmp_path / "protocol").mkdir()
    (tmp_path / "protocol" / "x.py").write_text("from . import framing\nfrom ..node import transport\n")
    assert imports(tmp_path / "protocol" / "x.py") == ["tape.protocol.framing", "tape.node"]


def constructed(path: Path) -> set[str]:
    """The names of the classes `path` calls (constructs), bare or through their module (`vn.VoterNode`)."""
    calls = [n.func for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    names = [f.id if isinstance(f, ast.Name) else f.attr for f in calls if isinstance(f, (ast.Name, ast.Attribute))]
    return {name for name in names if name[:1].isupper()}


def test_the_simulator_drives_node_cores_not_the_cores_a_shell_combines():
    """A core that a shell and the simulator both construct has its glue written twice, unless it is
    a node core. The simulator defines no role of its own beyond what NOT_YET_NODE_CORES still needs."""
    cores = {n.name for folder, p in modules() if is_pure(folder, p)
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}
    by_shells = set().union(*(constructed(ROOT / shell) for shell in SHELLS)) & cores
    twice = (constructed(ROOT / "ops" / "sim.py") & by_shells) - NODE_CORES - VALUES
    assert twice == NOT_YET_NODE_CORES
    assert NODE_CORES <= constructed(ROOT / "ops" / "sim.py") & by_shells


def test_no_module_is_left_in_an_old_place():
    assert not (ROOT / "tape").exists()
    for folder in LAYER:
        assert (ROOT / folder / "__init__.py").exists(), folder


MAX_FUNCTION_LINES = 70


def test_every_function_fits_on_a_screen():
    long = []
    for folder, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{folder}/{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
