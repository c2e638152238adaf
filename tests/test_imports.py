"""The import graph of jaxspec, pallas_kernels and checkpoints_convert runs one way: no cycle between modules
(imports inside functions included, read from the source), and every import of the project's own modules at
module top, so a deferred import cannot hide a cycle again."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxspec", "pallas_kernels", "checkpoints_convert")


def module_files() -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return files


def imports(name: str, path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, at module top) for every import in the file, nested ones included."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                while t not in modules:  # `import a.b.c` of a name in a module: the module
                    t = t.rpartition(".")[0]
                found.append((t, node.lineno, id(node) in top))
    return found


def graph() -> tuple[dict[str, set[str]], list[str]]:
    files = module_files()
    edges, deferred = {m: set() for m in files}, []
    for m, f in files.items():
        for t, line, at_top in imports(m, f, set(files)):
            if t != m:
                edges[m].add(t)
            if not at_top:
                deferred.append(f"{f.relative_to(ROOT)}:{line} imports {t} inside a function")
    return edges, deferred


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    edges, _ = graph()
    assert cycles(edges) == []


def test_project_imports_at_module_top():
    _, deferred = graph()
    assert deferred == []


def test_cycle_finder_sees_a_cycle():
    """The checker itself: a deliberate cycle (through a package __init__) and a clean chain."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_layers_run_one_way():
    """The layers DESIGN.md names: models never import the engine or above; the engine never imports the
    handles or above; kernels and pallas_kernels import nothing of the model code."""
    edges, _ = graph()
    above = {"models": ("jaxspec.engine", "jaxspec.decoder", "jaxspec.api", "jaxspec.cli", "jaxspec.model",
                        "jaxspec.drafter", "jaxspec.budget"),
             "engine": ("jaxspec.decoder", "jaxspec.api", "jaxspec.cli", "jaxspec.model", "jaxspec.drafter",
                        "jaxspec.budget", "jaxspec.batching"),
             "kernels": ("jaxspec.models", "jaxspec.cache", "jaxspec.engine", "jaxspec.checkpoint")}
    def under(m, *names):
        return any(m == n or m.startswith(n + ".") for n in names)

    bad = [(m, t) for m, ts in edges.items() for t in ts
           if (under(m, "jaxspec.models") and under(t, *above["models"]))
           or (m == "jaxspec.engine" and under(t, *above["engine"]))
           or (under(m, "jaxspec.kernels") and under(t, *above["kernels"]))
           or (under(m, "pallas_kernels") and under(t, "jaxspec"))
           or (under(m, "jaxspec") and under(t, "checkpoints_convert"))]
    assert bad == []
