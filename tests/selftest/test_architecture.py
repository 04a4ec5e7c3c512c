"""The package's structure: layers that do not import each other the wrong way round."""

from __future__ import annotations

import ast
import pathlib

import attncheck

PACKAGE = pathlib.Path(attncheck.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, module: str, modules) -> set[str]:
    """attncheck modules a module imports, at any level of its code, those under ``if
    TYPE_CHECKING:`` included: a layer that needs another's types for its annotations
    depends on it as much (``from package import module`` imports the module, not the
    package's other names)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            found.update(name for name in names if name in modules)
            if not all(name in modules for name in names):
                found.add(base)
    return {name for name in found if name.split(".")[0] == "attncheck"}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "gate" not in p.relative_to(PACKAGE).parts[:1]
               or p.name == "__init__.py"}
    return {name: {m for m in _imports(path, name, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20 and "attncheck.check" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["attncheck.bugclasses"] = graph["attncheck.bugclasses"] | {"attncheck.specs.base"}
    assert _cycle(graph) is not None


# Bottom to top. A module imports modules of its own layer and of those below it, never one
# above: a family's spec declares what the report draws (``layouts``) and does not import
# the report; a check makes records (the run's data) and imports nothing of the report that
# merges and renders them, which reads mutation summaries as data and imports no campaign or
# session; the run's drivers sit on top. A name is one module, ``package.*`` the package and
# everything under it; a module's own name decides before the longest package holding it.
LAYERS = (
    ("foundation", ("attncheck", "attncheck.env", "attncheck.cache_root", "attncheck.profiles",
                    "attncheck.structure", "attncheck.numerics", "attncheck.parameters", "attncheck.compiled",
                    "attncheck.compile_cache", "attncheck.cases", "attncheck.bugclasses", "attncheck.domain",
                    "attncheck.layouts", "attncheck.expectations", "attncheck.interpret_compat.*",
                    "attncheck.oracle.*", "attncheck.strategies.*", "attncheck.yardstick", "attncheck.third_party.*",
                    "attncheck.scheduling", "attncheck.watchdog")),
    ("backends", ("attncheck.backends",)),
    ("specs", ("attncheck.specs.*",)),
    ("run data", ("attncheck.report", "attncheck.report.records", "attncheck.report.errormap",
                  "attncheck.report.policy")),
    ("checks", ("attncheck.check", "attncheck.coverage", "attncheck.selection")),
    ("report", ("attncheck.report.*",)),
    ("drivers", ("attncheck.session.*", "attncheck.pytest_plugin", "attncheck.gate.*", "attncheck.mutation.*",
                 "attncheck.findings.*", "attncheck.__main__")),
)


def _layer_of(module: str) -> int:
    """The index in LAYERS of the module's own name, else of the longest package holding it."""
    for index, (_, names) in enumerate(LAYERS):
        if module in names:
            return index
    holding = [(len(name), index) for index, (_, names) in enumerate(LAYERS) for name in names
               if name.endswith(".*") and (module + ".").startswith(name[:-1])]
    assert holding, f"{module} is in no layer of LAYERS: place it"
    return max(holding)[1]


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[_layer_of(a)][0]}) imports {b} ({LAYERS[_layer_of(b)][0]})"
                  for a, imported in graph.items() for b in imported if _layer_of(b) > _layer_of(a))


def test_every_import_goes_to_its_own_layer_or_one_below():
    graph = import_graph()
    assert {LAYERS[_layer_of(m)][0] for m in graph} == {name for name, _ in LAYERS}
    assert _upward_imports(graph) == []
    assert not any(m.startswith("attncheck.report") for s in graph if s.startswith("attncheck.specs")
                   for m in graph[s])


def test_the_layer_check_finds_a_spec_that_imports_the_report():
    graph = import_graph()
    graph["attncheck.specs.flash.spec"] = graph["attncheck.specs.flash.spec"] | {"attncheck.report.render"}
    assert _upward_imports(graph) == ["attncheck.specs.flash.spec (specs) imports attncheck.report.render (report)"]


def test_the_oracle_and_the_kernels_stay_independent():
    """The oracle is NumPy float64 and imports nothing of jax or the kernels; the kernels
    import nothing of attncheck."""
    for path in (PACKAGE / "oracle").rglob("*.py"):
        assert not _imported_packages(path) & {"jax", "jaxlib", "attncheck_kernels"}, path
    for path in (PACKAGE.parent / "kernels").glob("*.py"):
        assert "attncheck" not in _imported_packages(path), path


def _imported_packages(path: pathlib.Path) -> set[str]:
    """The top-level packages a module imports."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return {n.split(".")[0] for n in names}


def test_the_plugin_imports_no_jax_until_a_run_asks_for_attncheck():
    import subprocess
    import sys

    probe = "import sys, attncheck.pytest_plugin; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_report_loads_the_interpreter_error_classification_without_the_patches():
    import subprocess
    import sys

    probe = ("import sys, attncheck.report.model; from attncheck.interpret_compat import limitation_lines; "
             "print(sorted(m for m in sys.modules if m.startswith('attncheck.interpret_compat.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['attncheck.interpret_compat.limitations']"
