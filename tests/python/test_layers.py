"""The package's structure, checked statically (ast) over vmm_torch's sources:

- layers: each module imports (anywhere, function bodies included) only modules of lower
  layers, so there is no import cycle;
- no module uses another module's private names (``from .x import _name``, ``x._name``);
- every public function, class method and the package's __init__ methods carry type
  annotations, and the package ships py.typed;
- every module imports on its own in a fresh interpreter.
"""

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

PACKAGE = "vmm_torch"
PACKAGE_DIR = importlib.util.find_spec(PACKAGE).submodule_search_locations[0]
HERE = os.path.dirname(os.path.abspath(__file__))

# Module -> layer. A module may import modules of lower layers only. New modules go here.
LAYERS = {
    "_signatures": 0,  # the C interface's ctypes declaration
    "_options": 0,     # option text
    "_tensors": 0,     # shapes, strides, dtype codes
    "_registry": 0,    # the open explicit pools
    "_devices": 0,     # device arguments
    "_files": 0,       # writing output files whole (dump_stats, the stats command line)
    "_pickles": 0,     # loading untrusted pickles of builtins (memory snapshots)
    "_cuda": 0,        # vmm's own CUDA allocator module, where built
    "_streams": 0,     # the stream of an allocation as pools take it (foreign mark)
    "_settings": 0,    # PyTorch's allocator settings at run time (a backend named)
    "stats": 1,        # the dump reader (no libraries; writes with _files)
    "_lib": 1,         # loading, errors by code, call helpers
    "descriptors": 2,
    "allocator": 2,
    "pool": 3,
    "mempool": 3,
    "sharing": 3,
    "reductions": 4,
    "distributed": 4,
    "autoenable": 5,
    "__init__": 5,
}


def _sources():
    return sorted(f[:-3] for f in os.listdir(PACKAGE_DIR) if f.endswith(".py"))


def _tree(module):
    with open(os.path.join(PACKAGE_DIR, module + ".py")) as f:
        return ast.parse(f.read(), filename=f"{PACKAGE}/{module}.py")


MODULES = _sources()


def _package_imports(module):
    """[(imported module, [(name, lineno)] imported from it, or None for the module itself)]
    of the package's own modules that `module` imports."""
    found = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith(PACKAGE):
                continue
            if node.level > 1:
                raise AssertionError(f"{module}: relative import beyond the package")
            path = node.module or ""
            if node.level == 0:
                path = path[len(PACKAGE):].lstrip(".")
            if not path:  # from . import a, b: modules
                for alias in node.names:
                    found.append((alias.name, None, node.lineno))
            else:
                found.append((path.split(".")[0], [(a.name, node.lineno) for a in node.names],
                              node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name.split(".")[1], None, node.lineno))
    return found


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYERS), (
        f"modules without a layer: {set(MODULES) - set(LAYERS)}; "
        f"layers without a module: {set(LAYERS) - set(MODULES)}")


@pytest.mark.parametrize("module", MODULES)
def test_imports_go_down_the_layers(module):
    for imported, _, line in _package_imports(module):
        assert imported in LAYERS, f"{module}:{line} imports unknown module {imported}"
        assert LAYERS[imported] < LAYERS[module], (
            f"{module}.py:{line} (layer {LAYERS[module]}) imports {imported} "
            f"(layer {LAYERS[imported]})")


def test_the_import_graph_has_no_cycle():
    graph = {m: {i for i, _, _ in _package_imports(m)} for m in MODULES}
    done, active = set(), []

    def visit(m):
        if m in active:
            raise AssertionError("import cycle: " + " -> ".join(active[active.index(m):] + [m]))
        if m in done:
            return
        active.append(m)
        for n in graph.get(m, ()):
            visit(n)
        active.pop()
        done.add(m)

    for m in MODULES:
        visit(m)


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("module", MODULES)
def test_no_private_names_of_other_modules(module):
    tree = _tree(module)
    module_names = set()  # local names bound to sibling modules
    for imported, names, line in _package_imports(module):
        if names is None:
            module_names.add(imported)
            continue
        for name, line in names:
            if name in LAYERS:  # from .x import submodule (not used in this package)
                continue
            assert not _is_private(name), f"{module}.py:{line}: imports {imported}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + ".") and alias.asname:
                    module_names.add(alias.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_names and _is_private(node.attr)):
            raise AssertionError(
                f"{module}.py:{node.lineno}: uses {node.value.id}.{node.attr}, a private name")


def _unannotated(function):
    missing = []
    args = function.args
    params = args.posonlyargs + args.args + args.kwonlyargs
    for i, arg in enumerate(params):
        if i == 0 and arg.arg in ("self", "cls"):
            continue
        if arg.annotation is None:
            missing.append(arg.arg)
    for arg in (args.vararg, args.kwarg):
        if arg is not None and arg.annotation is None:
            missing.append(arg.arg)
    if function.returns is None:
        missing.append("return")
    return missing


@pytest.mark.parametrize("module", MODULES)
def test_public_functions_are_annotated(module):
    tree = _tree(module)
    problems = []

    def check(function, where):
        missing = _unannotated(function)
        if missing:
            problems.append(f"{module}.py:{function.lineno} {where}{function.name}: "
                            f"{', '.join(missing)}")

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not _is_private(node.name):
                check(node, "")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        not item.name.startswith("_") or item.name == "__init__"):
                    check(item, node.name + ".")
    assert not problems, "unannotated:\n" + "\n".join(problems)


def test_py_typed_is_shipped():
    # In a checkout and in Bazel's runfiles (tests/python:layers_test has it as data).
    marker = os.path.join(HERE, "..", "..", "torch_plugin", "python", PACKAGE, "py.typed")
    assert os.path.exists(marker)
    setup = os.path.join(HERE, "..", "..", "torch_plugin", "python", "setup.py")
    if os.path.exists(setup):  # a checkout (runfiles hold no setup.py)
        with open(setup) as f:
            assert '"py.typed"' in f.read()


def test_every_module_imports_in_a_fresh_interpreter():
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "print('ok')\n")
    names = [PACKAGE] + [f"{PACKAGE}.{m}" for m in MODULES if m != "__init__"]
    for name in names:  # one interpreter per module: each imports on its own
        result = subprocess.run([sys.executable, "-c", code, name], capture_output=True,
                                text=True, timeout=120, env=_env())
        assert result.returncode == 0 and result.stdout.strip() == "ok", (name, result.stderr)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env
