"""The code's layers: data flows one way, and no module imports its way back up.

``storage`` (formats, object storage, the local store) knows nothing of the
pipeline; ``tasks`` (the stages) build on ``storage``; ``flows`` (the flows
and their command lines) compose the stages; ``deployments`` sits on top of
the product. ``testbed`` (the lab infrastructure) may import the product,
which never imports it; ``benchmarks`` may import both. Nothing in the product,
the testbed or the benchmarks imports ``tests``, and no test imports
``benchmarks`` (a test runs a benchmark as a command). Every import counts,
including those inside functions: a lazy import that goes up is still a cycle
in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"storage": 0, "tasks": 1, "flows": 2, "deployments": 3, "testbed": 4, "benchmarks": 5}
PRODUCT = ("storage", "tasks", "flows", "deployments")


def _modules() -> dict[str, Path]:
    out = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` (a script's entry point) or ``if TYPE_CHECKING:`` (annotations only):
    neither imports anything when the module is imported."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"


def _imports(path: Path) -> set[str]:
    found = set()
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not _is_main_block(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_module_imports_a_higher_layer_or_the_tests():
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    upward = []
    for name, path in _modules().items():
        layer = LAYERS[name.split(".")[0]]
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top in test_modules:
                upward.append(f"{name} imports the tests ({imported})")
            elif top in LAYERS and LAYERS[top] > layer:
                upward.append(f"{name} imports {imported} from a higher layer")
    assert upward == []


def _test_modules() -> dict[str, Path]:
    """The modules under tests/ (test files, their support modules, conftest), by name."""
    return {".".join(p.relative_to(ROOT / "tests").with_suffix("").parts): p
            for p in sorted((ROOT / "tests").rglob("*.py"))}


def test_the_testbed_builds_on_the_product_which_never_imports_it():
    modules = _modules()
    imports = {name: _imports(path) for name, path in modules.items()}
    wrong = [f"{name} imports {imported}" for name in modules if name.split(".")[0] in PRODUCT
             for imported in imports[name] if imported.split(".")[0] in ("testbed", "benchmarks")]
    assert wrong == []
    testbed = [name for name in modules if name.split(".")[0] == "testbed"]
    assert {"testbed", "testbed.processes", "testbed.fleet"} <= set(testbed)  # the layer exists and is scanned
    assert any(i.split(".")[0] in PRODUCT for name in testbed for i in imports[name])


def test_tests_and_benchmarks_do_not_import_each_other():
    """No test imports a benchmark (a test runs one as a command); no benchmark or testbed module imports the
    tests' modules (``lab``, ``s3_support``, ..., or ``tests`` itself)."""
    tests = _test_modules()
    assert "conftest" in tests and "system.test_layers" in tests
    test_names = {name.split(".")[-1] for name in tests} | {"tests"}
    crossing = [f"tests/{path.relative_to(ROOT / 'tests')} imports {imported}"
                for path in tests.values() for imported in _imports(path) if imported.split(".")[0] == "benchmarks"]
    for name, path in _modules().items():
        if name.split(".")[0] in ("benchmarks", "testbed"):
            crossing += [f"{name} imports the tests ({imported})" for imported in _imports(path)
                         if imported.split(".")[0] in test_names]
    assert crossing == []


def test_there_are_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_layer_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from flows.cli import main\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "flows.cli" for n in ast.walk(tree))


# the rooms of storage/ (storage/__init__.py): each may import only the rooms listed for it
ROOMS = {"format": set(), "objects": {"format"}, "catalog": {"objects", "format"}, "store": {"format"},
         "patch": {"store", "catalog", "objects", "format"}}


def _room(module: str) -> str | None:
    """``format``, ``objects``, ... for a module of a room; ``""`` for a cross-cutting storage module."""
    parts = module.split(".")
    if parts[0] != "storage" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ROOMS else ""


def test_storage_rooms_import_only_the_rooms_below_them():
    crossing = []
    for name, path in _modules().items():
        room = _room(name)
        if room is None:
            continue
        for imported in _imports(path):
            target = _room(imported)
            if target is None or target == room:
                continue  # outside storage, or the same room
            if room == "" and target != "":
                crossing.append(f"{name} (cross-cutting) imports {imported}")
            elif target != "" and target not in ROOMS.get(room, set()):
                crossing.append(f"{name} ({room}) imports {imported} ({target})")
    assert crossing == []


def test_every_room_says_what_it_holds_and_what_it_may_import():
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "storage" / room / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"storage/{room}/__init__.py has no docstring naming its imports"


def test_tests_live_in_rooms_and_never_edit_the_import_path():
    """Tests mirror the product's rooms (unit by room, system, crash) with one support package; a test finds
    its helpers as ``tests.support.*`` because ``tests`` is a package, so no file edits the import path."""
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == []  # none left on the flat floor
    rooms = {p.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")}
    assert rooms == {"unit", "system", "crash"}
    editing = [str(p.relative_to(ROOT)) for p in tests.rglob("*.py") if "sys" + ".path" in p.read_text()]
    assert editing == []
    missing = [str(d.relative_to(ROOT)) for d in [tests, *tests.rglob("*")] if d.is_dir()
               and d.name != "__pycache__" and not (d / "__init__.py").exists()]
    assert missing == []


def test_no_product_module_over_450_lines_and_no_function_over_80():
    """Rooms stay readable: a product module (storage, tasks, flows, deployments) holds at most 450 lines and a
    function (or method) at most 80, counted from its ``def`` to its last line."""
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        if name.split(".")[0] not in PRODUCT:
            continue
        source = path.read_text()
        if source.count("\n") > 450:
            long_modules.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_functions == []
    storage_top = sorted(p.stem for p in (ROOT / "storage").glob("*.py") if p.stem != "__init__")
    assert len(storage_top) <= 6, storage_top
