"""The package's shape: no import cycles, small modules, one table."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / "src" / "keras_dtensor"
MAX_LINES = 400


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path, modules):
    """Package modules `path` imports, at module level or in functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names
            ]
        else:
            continue
        for name in names:
            if name in modules and name != "keras_dtensor":
                found.add(name)
    return found


def _cycles(graph):
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_the_backend_imports_nothing_above_it():
    modules = _modules()
    low = {
        "keras_dtensor.backend.distribution_lib",
        "keras_dtensor.backend.launch",
        "keras_dtensor.backend.layout",
        "keras_dtensor.backend.errors",
        "keras_dtensor.config",
        "keras_dtensor.backend.placement_order",
    }
    for name in low:
        assert _imports(modules[name], modules) <= low, name


# The one table of replacements is data: one row per hook, kept whole
# (until it is split by what it patches, Keras rows and torch rows).
LIMITS = {"keras_dtensor.patches": 640}


def test_modules_stay_small():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines()))
        > LIMITS.get(name, MAX_LINES)
    }
    assert not long, long


def test_environment_variables_are_read_only_in_config():
    for name, path in _modules().items():
        if name == "keras_dtensor.config":
            continue
        text = path.read_text()
        assert '"KERAS_DTENSOR_' not in text.replace(
            '"KERAS_DTENSOR_SAVE_TIMEOUT sets', ""
        ), name


def test_data_parallel_is_entered_only_through_its_package():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("keras_dtensor.data_parallel"):
            continue
        inner = {
            m
            for m in _imports(path, modules)
            if m.startswith("keras_dtensor.data_parallel.")
        }
        assert not inner, (name, inner)
