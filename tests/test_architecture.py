"""The package's shape: folders by part, arrows down, small modules.

Folders are layers: a module imports its own folder and folders of a lower
rank only. The strategy folders are entered through their package.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / "src" / "keras_dtensor"
MAX_LINES = 400
# Lower imports higher never: saving and checkpoints save what the
# strategies hold; hooks wrap Keras around all of them; the table installs
# the hooks; the package's face installs the table.
RANK = {
    "base": 0,  # config, compat
    "backend": 1,
    "ops": 2,
    "planning": 3,
    "model_parallel": 3,
    "data_parallel": 3,
    "saving": 4,
    "checkpoint": 4,
    "hooks": 5,
    "patches": 6,
    "face": 7,  # __init__, cli, demo
}
# Folders entered through their package only (their `__init__`).
ENTERED_AS_PACKAGE = {
    "planning",
    "model_parallel",
    "data_parallel",
    "saving",
    "checkpoint",
}
# The face defers imports: the environment is checked before Keras's torch
# internals load, `plan` and checkpoints are imported on first use, and
# the command line starts without Keras.
DEFERS_IMPORTS = {"keras_dtensor", "keras_dtensor.cli", "keras_dtensor.demo"}


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _folder(name):
    parts = name.split(".")
    if len(parts) == 1:
        return "face"
    if len(parts) == 2 and (PACKAGE / f"{parts[1]}.py").exists():
        return "base" if parts[1] in ("config", "compat") else "face"
    return parts[1]


def _targets(node, modules):
    """`(module, name)` of each package module an import statement loads;
    `name` is the imported name when it is not a module."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in modules]
    if not (isinstance(node, ast.ImportFrom) and node.module in modules):
        return []
    found = []
    for alias in node.names:
        full = f"{node.module}.{alias.name}"
        if full in modules:
            found.append((full, None))
        else:
            found.append((node.module, alias.name))
    return found


def _imports(path, modules, top_level_only=False):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    name = _module_name(path)
    return {
        (target, imported, getattr(node, "lineno", 0))
        for node in nodes
        for target, imported in _targets(node, modules)
        if target != name and target != "keras_dtensor"
    }


def _graph(top_level_only=False):
    modules = _modules()
    return {
        name: {t for t, _, _ in _imports(path, modules, top_level_only)}
        for name, path in modules.items()
    }


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
    assert not _cycles(_graph()), _cycles(_graph())


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_every_module_is_in_a_ranked_folder():
    assert {_folder(name) for name in _modules()} == set(RANK)


def test_arrows_point_down():
    modules = _modules()
    wrong = sorted(
        (name, target)
        for name, path in modules.items()
        for target, _, _ in _imports(path, modules)
        if _folder(target) != _folder(name)
        and RANK[_folder(target)] >= RANK[_folder(name)]
    )
    assert not wrong, wrong


def test_the_arrow_check_finds_an_upward_import():
    assert (
        RANK[_folder("keras_dtensor.hooks.data")]
        > RANK[_folder("keras_dtensor.backend.layout")]
    )
    assert _folder("keras_dtensor.config") == "base"
    assert _folder("keras_dtensor.cli") == "face"


def test_strategy_folders_are_entered_through_their_package():
    modules = _modules()
    inner = sorted(
        (name, target)
        for name, path in modules.items()
        for target, _, _ in _imports(path, modules)
        if _folder(target) in ENTERED_AS_PACKAGE
        and _folder(target) != _folder(name)
        and target.count(".") > 1
    )
    assert not inner, inner


def test_no_private_name_is_imported_from_another_module():
    modules = _modules()
    private = sorted(
        (name, target, imported)
        for name, path in modules.items()
        for target, imported, _ in _imports(path, modules)
        if imported is not None and imported.startswith("_")
    )
    assert not private, private


def test_function_level_imports_guard_a_cycle():
    # An import inside a function that could be at the top of the module
    # (no cycle results) only hides the module's dependencies.
    modules = _modules()
    graph = _graph(top_level_only=True)

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
                parts = node.split(".")
                todo.extend(".".join(parts[:k]) for k in range(2, len(parts)))
        return False

    free = []
    for name, path in modules.items():
        if name in DEFERS_IMPORTS:
            continue
        top = _imports(path, modules, top_level_only=True)
        for target, _, line in _imports(path, modules) - top:
            if not reaches(target, name):
                free.append(f"{name}:{line} -> {target}")
    assert not free, free


def test_per_object_state_goes_through_object_state():
    owners = {
        "keras_dtensor.backend.object_state",
        "keras_dtensor.patches.patch_kinds",
    }
    for name, path in _modules().items():
        if name in owners:
            continue
        text = path.read_text()
        assert "__dict__[" not in text, name
        assert "object.__setattr__(" not in text, name


def test_no_module_level_rebinding():
    # Module-level data is the table and saved originals; state lives on
    # Keras objects or in Keras's global state.
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            assert not isinstance(node, ast.Global), name


def test_every_module_is_named_in_its_folder_docstring():
    # A newcomer opening a folder learns from its `__init__` what each
    # module there does: every module and subpackage is named in it.
    unnamed = []
    for init in PACKAGE.rglob("__init__.py"):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        names += [
            p.name for p in folder.iterdir() if (p / "__init__.py").exists()
        ]
        unnamed += [
            f"{folder.relative_to(PACKAGE.parent)}/{name}"
            for name in names
            if f"`{name}`" not in doc
        ]
    assert not unnamed, unnamed


def test_modules_stay_small():
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
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
