"""The package's import rules (STYLE.md section 1), read from the source with ``ast``.

Every ``import`` counts, at module level or inside a function (a lazy import is still an
import). Every folder of ``compress/`` is a package and the folder graph is the import graph.
Rules:

- no import cycle between modules;
- ``compress.kernels`` imports only torch, triton, numpy, the standard library and itself;
- the passes (``pass_algorithms``, read from the folders, and ``PASS_SHARED``) never import
  evaluation, the runtime or the CLI, and no pass algorithm imports another (they share
  ``quant.scheme`` and ``quant.calibrated`` instead);
- checkpoint I/O and the layer types it builds (``io_modules``) import no pass, not even
  through other modules;
- nothing imports the CLI, and only the CLI imports the HTTP server (``runtime.server``).

Imports under ``if TYPE_CHECKING:`` are not counted: they never run (annotations only).
The implicit import of a parent package (``compress/__init__.py`` runs before any submodule)
is not an edge here; the subprocess test checks what ``import compress.kernels`` and the load
path really import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder
PACKAGE_DIRS = {"compress": "compress"}

# Who is a pass, read from the folders (a new algorithm module is covered without a list edit):
# every module of compress/quant/ except the shared ones below, every module of compress/prune/
# except its shared ones, and distillation.
QUANT_SHARED = {  # shared by the algorithms (kv_scales: also by checkpoint I/O and the runtime)
    "scheme", "primitives", "linear", "calibrated", "coverage", "experts", "kv_scales",
}  # fmt: skip
PRUNE_SHARED = {"config", "slicing"}  # shared by the structured-pruning passes
PASS_SHARED = {
    "compress.quant.scheme",  # settings shared by the weight-quantization passes
    "compress.quant.coverage",  # what a quantization pass reached (reports, strict)
    "compress.quant.experts",  # fused MoE experts: targets, schemes, RTN
    "compress.quant.calibrated",  # layer-by-layer calibration scaffolding
    "compress.calibration",  # calibration text
    "compress.optim",  # distillation's optimizers
}
PASS_MAY_NOT_IMPORT = ("compress.eval", "compress.runtime", "compress.cli")


def pass_algorithms(modules: Iterable[str]) -> set[str]:
    found = {"compress.distill"}
    for name in modules:
        package, _, leaf = name.rpartition(".")
        if (package == "compress.quant" and leaf not in QUANT_SHARED) or (
            package == "compress.prune" and leaf not in PRUNE_SHARED
        ):
            found.add(name)
    return found


def io_modules(modules: Iterable[str]) -> set[str]:
    """Checkpoint writing/reading/inspection, the load path and the layer types it builds."""
    io = {name for name in modules if name.startswith("compress.io.")}
    return io | {"compress.quant.linear", "compress.quant.kv_scales", "compress.output_dir"}


KERNEL_DEPENDENCIES = {"torch", "triton", "numpy"}

Edge = tuple[str, str, int]  # (importer, imported module, line)


def read_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source text for every .py file of the installed packages."""
    sources = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            sources[name] = path.read_text()
    return sources


def _is_package(name: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(name + ".") for other in sources)


def _known(name: str, sources: dict[str, str]) -> str:
    """``name`` itself if it is one of our modules, else its longest prefix that is."""
    while name not in sources and "." in name:
        name = name.rpartition(".")[0]
    return name


def _runtime_nodes(node: ast.AST) -> Iterable[ast.AST]:
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:`` (never run)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
        else:
            yield from _runtime_nodes(child)


def imports_of(module: str, source: str, sources: dict[str, str]) -> list[tuple[str, int]]:
    """Every module ``module`` imports (absolute names, ours resolved to a module of
    ``sources``), with its line: ``import a.b``, ``from a import b`` (b a module or a name in a),
    relative imports, anywhere in the file."""
    package = module if _is_package(module, sources) else module.rpartition(".")[0]
    found = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((candidate if candidate in sources else base, node.lineno))
    return [
        (_known(name, sources) if name.split(".")[0] == "compress" else name, line)
        for name, line in found
    ]


def import_edges(sources: dict[str, str]) -> list[Edge]:
    return sorted({
        (module, target, line)
        for module, source in sources.items()
        for target, line in imports_of(module, source, sources)
    })


def _where(edge: Edge) -> str:
    module, target, line = edge
    return f"{module}:{line} imports {target}"


def find_cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """Strongly connected components of the import graph that contain a cycle (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for module, target, _ in edges:
        if target.split(".")[0] == "compress":
            graph.setdefault(module, set()).add(target)
            graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _reachable(start: str, edges: list[Edge]) -> dict[str, list[Edge]]:
    """Modules reachable from ``start`` -> one import chain that reaches them."""
    chains: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        module = todo.pop()
        for edge in edges:
            if edge[0] == module and edge[1] not in chains:
                chains[edge[1]] = [*chains[module], edge]
                todo.append(edge[1])
    return chains


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken import rule (see the module docstring), one line each."""
    edges = import_edges(sources)
    algorithms = pass_algorithms(sources)
    pass_modules = algorithms | PASS_SHARED
    problems = []
    for cycle in find_cycles(edges):
        members = set(cycle)
        inside = [_where(e) for e in edges if e[0] in members and e[1] in members]
        problems.append(f"import cycle {' <-> '.join(cycle)}: {'; '.join(inside)}")
    stdlib = set(sys.stdlib_module_names)
    for edge in edges:
        module, target, _ = edge
        root = target.split(".")[0]
        if module.startswith("compress.kernels") and not (
            target == "compress.kernels"
            or target.startswith("compress.kernels.")
            or root in KERNEL_DEPENDENCIES | stdlib
        ):
            problems.append(f"kernels may import only torch/triton/numpy/stdlib: {_where(edge)}")
        if module in pass_modules and target.startswith(PASS_MAY_NOT_IMPORT):
            problems.append(f"a pass may not import eval, runtime or cli: {_where(edge)}")
        if module in algorithms and target in algorithms and target != module:
            problems.append(
                f"a pass may not import another pass (share compress.quant.scheme or "
                f"compress.quant.calibrated): {_where(edge)}"
            )
        if target == "compress.cli" and module != "compress.cli":
            problems.append(f"nothing may import the CLI: {_where(edge)}")
        if target == "compress.runtime.server" and module not in ("compress.cli", target):
            problems.append(f"only the CLI may import the HTTP server: {_where(edge)}")
    for module in sorted(io_modules(sources) & set(sources)):
        for target, chain in _reachable(module, edges).items():
            # the first pass on each chain only: what it imports in turn adds nothing
            if target in pass_modules and not any(e[1] in pass_modules for e in chain[:-1]):
                path = " -> ".join(_where(e) for e in chain)
                problems.append(f"checkpoint I/O may not import a pass: {path}")
    return problems


def test_package_follows_the_import_rules():
    sources = read_sources()
    assert {"compress.core", "compress.eval.latency", "compress.kernels.dispatch"} <= set(sources)
    algorithms = pass_algorithms(sources)
    assert {"compress.quant.gptq", "compress.quant.awq", "compress.distill"} <= algorithms
    assert "compress.quant.linear" not in algorithms  # a layer type, not a pass
    assert PASS_SHARED | io_modules(sources) <= set(sources), "a listed module no longer exists"
    problems = violations(sources)
    assert not problems, "import rules broken:\n  " + "\n  ".join(problems)


def _with(sources: dict[str, str], module: str, line: str) -> dict[str, str]:
    """``sources`` with ``line`` added inside a function of ``module`` (a lazy import)."""
    return {**sources, module: sources[module] + f"\n\ndef _added():\n    {line}\n"}


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("compress.quant.linear", "from compress.quant.gptq import GptqConfig", "import cycle"),
        ("compress.kernels.reference", "from compress.core.errors import DataError", "kernels may"),
        ("compress.kernels.dispatch", "import transformers", "kernels may"),
        ("compress.quant.rtn", "from compress.eval import latency", "pass may not import eval"),
        ("compress.quant.awq", "from compress.quant.gptq import GptqConfig", "another pass"),
        ("compress.io.inspect", "import compress.quant.awq", "I/O may not import a pass"),
        ("compress.eval.compare", "from compress import cli", "nothing may import the CLI"),
        ("compress.eval.serving", "import compress.runtime.server", "only the CLI may import"),
    ],
)
def test_a_broken_rule_is_reported(module, line, expected):
    problems = violations(_with(read_sources(), module, line))
    assert any(expected in p and module in p for p in problems), problems


def test_importing_kernels_or_the_load_path_imports_no_pass():
    passes = sorted(pass_algorithms(read_sources()) | PASS_SHARED)
    code = (
        "import sys\n"
        "import compress.kernels\n"
        f"passes = {passes!r}\n"
        "print(sorted(m for m in passes if m in sys.modules))\n"
        "import compress.io.export, compress.io.inspect, compress.io.load\n"
        "print(sorted(m for m in passes if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    after_kernels, after_load_path = out.stdout.splitlines()
    assert after_kernels == "[]", f"import compress.kernels imported passes: {after_kernels}"
    assert after_load_path == "[]", f"the load path imported passes: {after_load_path}"


def test_a_config_imported_alone_names_its_pass():
    """``run_passes`` finds a pass by its config's type: importing a config's own module must
    register the pass, without ``compress.recipe`` (prune's configs live apart from the passes).
    """
    from compress.recipe import PASSES

    configs = sorted({(s.config_cls.__module__, s.config_cls.__name__) for s in PASSES.values()})
    code = (
        "import importlib\n"
        "from compress.core.registry import pass_name_of\n"
        f"for module, name in {configs!r}:\n"
        "    cls = getattr(importlib.import_module(module), name)\n"
        "    print(pass_name_of(cls.model_construct()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split()) == sorted(PASSES)
