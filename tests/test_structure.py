"""The package's shape: no import cycles, every collective in the communication module, short functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "convit_scale"
COLLECTIVES = re.compile(r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather|all_gather_object|all_gather_into_tensor|"
                         r"broadcast|broadcast_object_list|barrier|reduce|reduce_scatter|reduce_scatter_tensor|gather|"
                         r"gather_object|scatter|all_to_all|send|recv)\(")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """convit_scale modules imported anywhere in the file (lazy imports inside functions included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("convit_scale")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("convit_scale"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import comm` names a module
    return found


def test_no_module_imports_one_that_imports_it_back():
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}
    # a package's __init__ importing its own submodules is how packages re-export; not a cycle of concern
    for m in graph:
        graph[m] = {i for i in graph[m] if not (files[m].name == "__init__.py" and i.startswith(m + "."))}
    cycles = []

    def visit(node, stack, on_stack, done):
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, on_stack, done)
        on_stack.discard(node)
        stack.pop()
        done.add(node)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [], set(), done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_collective_goes_through_the_communication_module():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "comm.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COLLECTIVES.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert not offenders, "collectives outside convit_scale/train/comm.py:\n" + "\n".join(offenders)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80 and not (path.name == "config.py" and node.name == "validate"):
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
