"""The card's layout holds: imports go ops -> roles -> runtime -> protocol, never back; roles
do not import each other; inside ops, cli -> bench -> verification and spark; the pure layer does
no I/O; a module's name says whether it is pure (docs/architecture.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"protocol": 0, "runtime": 1, "sequencer": 2, "rewinder": 2, "replicas": 2, "ops": 3}
# ops/ by purpose: the operator's commands may use everything below; the benchmarks the harness.
OPS_LAYER = {"spark": 0, "verification": 0, "bench": 1, "cli": 2}
# What a sans-I/O module may not touch: sockets, files, processes, the clock, randomness.
IO_MODULES = {"asyncio", "socket", "os", "time", "random", "lmdb", "pathlib", "subprocess", "threading", "io",
              "shutil", "tempfile", "selectors", "signal", "datetime"}
# The naming convention: every module of protocol/ is pure, and so is every `*_core.py`; nothing
# else is. A process's shell is its `*_shell.py`.
PURE_SUFFIX, SHELL_SUFFIX = "_core.py", "_shell.py"
# A process's node core: every decision of that process. The shell and the simulator drive it, and
# only it, of the cores it combines.
NODE_CORES = {"EmitterNode", "VoterNode", "RewinderNode", "ReplicaNode", "SequencerNode", "ClientNode"}
SIMULATOR = ROOT / "ops" / "verification" / "sim.py"
# Cores that a shell and the simulator both still drive, each with the glue around it written twice
# (issue 59): every role has its node core now, and this list stays empty.
NOT_YET_NODE_CORES: set[str] = set()
VALUES = {"PacketBuilder", "FrameReader", "Reader", "LeaderSettings",  # codecs and settings: both may build them
          "AuditMachine"}  # the replica's state, as its shell loads it from the disk (fresh when there is none)


def package_of(path: Path, root: Path = ROOT) -> str:
    return ".".join(["tape", *path.relative_to(root).parent.parts])


def imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions count; a relative
    import as the absolute name it stands for)."""
    out = []
    package = package_of(path, root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            out += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
    return out


# protocol/'s one module that is not a core: it reads the environment once, at import, to choose
# which implementation loads (TAPE_PURE=1 hides the C extensions).
NOT_PURE_IN_PROTOCOL = {"extensions.py", "__init__.py"}


def is_pure(folder: str, path: Path) -> bool:
    return (folder == "protocol" and path.name not in NOT_PURE_IN_PROTOCOL) or path.name.endswith(PURE_SUFFIX)


def modules():
    for folder in LAYER:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield folder, path


def where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def violations(layer=LAYER) -> list[str]:
    found = []
    for folder, path in modules():
        for name in imports(path):
            parts = name.split(".")
            if parts[0] != "tape" or len(parts) < 2:
                continue
            target = parts[1]
            if target not in layer:
                found.append(f"{where(path)} imports unknown package {name}")
            elif target != folder and layer[target] >= layer[folder]:
                found.append(f"{where(path)} imports {name}")
            elif folder == target == "ops" and len(parts) > 2 and _ops_upward(path, parts[2]):
                found.append(f"{where(path)} imports {name}")
    return found


def _ops_upward(path: Path, target: str) -> bool:
    here = path.relative_to(ROOT / "ops").parts[0]
    if here not in OPS_LAYER or target not in OPS_LAYER:
        return here in OPS_LAYER and target not in OPS_LAYER  # ops' modules all live in its four folders
    return here != target and OPS_LAYER[target] >= OPS_LAYER[here]


def test_imports_only_go_down_the_layers():
    assert violations() == []


def test_the_check_fails_on_an_upward_import():
    # Judged with ops placed below the roles, ops' imports of the roles are violations.
    assert any(v.startswith("ops/cli/main.py imports tape.sequencer") for v in violations({**LAYER, "ops": 1}))


def test_the_check_fails_on_an_upward_import_inside_ops(monkeypatch):
    monkeypatch.setitem(OPS_LAYER, "cli", 0)  # the commands below the benchmarks: they import them
    assert any(v.startswith("ops/cli/main.py imports tape.ops.bench") for v in violations())


def test_no_pure_module_does_io_or_imports_one_that_may():
    """No sockets, files, processes, clock or randomness in a pure module, nor any import of a module
    of Tape's that is not pure itself."""
    pure = {package_of(p) + "." + p.stem for folder, p in modules() if is_pure(folder, p)}
    bad = []
    for folder, path in modules():
        if is_pure(folder, path):
            for name in imports(path):
                top = name.split(".")[0]
                compiled = name.rsplit(".", 1)[-1].startswith("_")  # a C twin of pure functions, held equal
                if top in IO_MODULES or (top == "tape" and name not in pure and name.count(".") > 1 and not compiled):
                    bad.append(f"{where(path)} imports {name}")
    assert bad == []


def test_every_node_core_and_shell_is_named_as_such():
    """The convention is total: each class the simulator must drive sits in a `*_core.py` (or
    protocol/), and each process's entry point in a `*_shell.py` that constructs one of them."""
    homes = {n.name: (folder, p) for folder, p in modules() for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.ClassDef) and n.name in NODE_CORES}
    assert set(homes) == NODE_CORES
    assert all(is_pure(folder, p) for folder, p in homes.values())
    for shell in shells():
        assert constructed(shell) & NODE_CORES, f"{where(shell)} drives no node core"


def test_no_two_modules_share_a_name():
    """Across the layers a name means one thing: `voter` is not a core here and a shell there."""
    seen: dict[str, list[str]] = {}
    for _, path in modules():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(where(path))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def shells() -> list[Path]:
    return [p for _, p in modules() if p.name.endswith(SHELL_SUFFIX)]


def test_the_purity_check_sees_relative_imports(tmp_path):
    (tmp_path / "runtime" / "storage").mkdir(parents=True)
    source = "from . import quarantine\nfrom ...protocol import framing\n"
    (tmp_path / "runtime" / "storage" / "x.py").write_text(source)
    assert imports(tmp_path / "runtime" / "storage" / "x.py", tmp_path) == ["tape.runtime.storage.quarantine",
                                                                             "tape.protocol"]


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
    by_shells = set().union(*(constructed(shell) for shell in shells())) & cores
    twice = (constructed(SIMULATOR) & by_shells) - NODE_CORES - VALUES
    assert twice == NOT_YET_NODE_CORES
    assert NODE_CORES <= constructed(SIMULATOR) & by_shells


def test_no_module_is_left_in_an_old_place():
    assert not (ROOT / "tape").exists() and not (ROOT / "node").exists()
    for folder in LAYER:
        for package in {p.parent for p in (ROOT / folder).rglob("*.py")}:
            assert (package / "__init__.py").exists(), package
    assert not list((ROOT / "ops").glob("*.py"))[1:], "ops/ keeps its modules in its four folders"


MAX_FUNCTION_LINES = 70


def test_every_function_fits_on_a_screen():
    long = []
    for folder, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{where(path)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
