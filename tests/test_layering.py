"""kvcache's imports go one way (docs/ARCHITECTURE.md): no module imports another in a circle,
counting imports inside functions, the package ``__init__`` every import runs and the modules a
package discovers (the policies and storages), and the lower layers never import the upper ones."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache

ROOT = Path(kvcache.__file__).parent

# Each layer may import only the layers listed for it (and itself, and the leaf modules below).
LOWER = {
    "kvcache.quant": set(),
    "kvcache.kernels": {"kvcache.quant"},
}
# Modules everything may import: they import nothing of kvcache. (model.scores is the rule a
# family puts on attention scores, which the attention kernels apply; the model and runtime
# packages' __init__ files are their docstrings.)
LEAVES = {"kvcache.errors", "kvcache.runtime", "kvcache.runtime.devices", "kvcache.model", "kvcache.model.scores"}
# Integrations, front ends and the report that compares engines: nothing in the library below
# them imports them.
TOP = {"kvcache.hf", "kvcache.vllm", "kvcache.cli", "kvcache.train", "kvcache.eval"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(name: str) -> set[str]:
    """The kvcache modules that importing ``name`` (or calling its functions) imports directly,
    with the packages whose ``__init__`` each import runs."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{alias.name}" for alias in node.names] + [target]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for t in targets:
            # Every import of a submodule runs kvcache/__init__, which assembles the public API.
            if t in MODULES and t != "kvcache":
                found.add(t)
                parts = t.split(".")
                found.update(".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in MODULES)
    found |= discovered(name, tree, package)
    found.discard(name)
    # A package's __init__ importing its own submodules is how packages are assembled, not a
    # dependency of the submodules on each other: only edges from a module to others count.
    return found


def discovered(name: str, tree: ast.Module, package: str) -> set[str]:
    """The modules ``name`` imports by discovery: every module of a package whose ``__path__`` it
    walks with ``pkgutil.iter_modules`` (and imports with importlib), its own or one it imported."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            for alias in node.names:
                aliases[alias.asname or alias.name] = ".".join(base + ([node.module] if node.module else []) + [alias.name])
    walked = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "iter_modules" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id == "__path__":
                walked.add(name)
            elif isinstance(arg, ast.Attribute) and arg.attr == "__path__" and isinstance(arg.value, ast.Name):
                walked.add(aliases.get(arg.value.id, arg.value.id))
    return {m for m in MODULES for p in walked if m.startswith(p + ".") and "." not in m[len(p) + 1:]}


def layer_of(name: str) -> str | None:
    for layer in (*LOWER, *TOP):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def test_modules_were_found():
    assert {"kvcache.cache.base", "kvcache.quant.codes", "kvcache.kernels.blocked", "kvcache.kernels.attention"} <= set(MODULES)


def test_no_import_cycle():
    graph = {name: imports(name) for name in MODULES}
    # A package's __init__ imports its submodules, which in turn run that __init__: those edges
    # are the package being assembled, not a cycle between modules.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not (name.startswith(d + ".") and MODULES[d].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_import_only_what_is_below_them():
    wrong = []
    for name in MODULES:
        layer = layer_of(name)
        if layer not in LOWER:
            continue
        for dep in imports(name):
            if dep in LEAVES or layer_of(dep) in (layer, *LOWER[layer]):
                continue
            wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong


def test_the_library_never_imports_its_integrations_or_front_ends():
    wrong = []
    for name in MODULES:
        if layer_of(name) in TOP or name in ("kvcache", "kvcache.__main__"):
            continue
        wrong += [f"{name} imports {dep}" for dep in imports(name) if layer_of(dep) in TOP]
    assert not wrong, wrong
