"""The card's layout holds: imports go ops -> roles -> node -> protocol, never
back; roles do not import each other; the pure layer does no I/O."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"protocol": 0, "node": 1, "sequencer": 2, "rewinder": 2, "replicas": 2, "ops": 3}
# What a sans-I/O module may not touch: sockets, files, processes, the clock, randomness.
IO_MODULES = {"asyncio", "socket", "os", "time", "random", "lmdb", "pathlib", "subprocess", "threading", "io",
              "shutil", "tempfile", "selectors", "signal", "datetime"}


def imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions count)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


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


def test_the_pure_layer_does_no_io():
    bad = [f"protocol/{p.name} imports {n}" for folder, p in modules() if folder == "protocol"
           for n in imports(p) if n.split(".")[0] in IO_MODULES]
    assert bad == []


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
