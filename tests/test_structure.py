"""The shape of the code (convit_scale/ and data_prep/): layers that import only downwards, no import cycles, every
collective in the communication module, short functions.

The layers, from the ground up (a module imports modules of lower layers and of its own unit only):

1. files: atomic writes and publication (every layer writes files); errors (bad input's exception, which every
   layer raises); jpeg_roi (the crop-region JPEG decoder's C library, which jpeg calls from compiled code and the
   WebDataset loader from Python); runfolder (the run folder's protocol: layout, exit statuses, checkpoint listings,
   the lease; shared by the ranks and the launcher);
2. leaves that import nothing of the package but files: comm, faults (a run's unplanned failures, as its launcher
   sees them), slurm_scripts (the #SBATCH reader), hardware, console, metrics, augment_policy, imagetree, splitmix and
   splitmix_numba (the counter-based generator of the augmentation and of drop-path, in torch and in numba),
   ffcv_threads, jpeg (shared by the loaders and data_prep/), gpu_wheels (the GPU box's wheel folder), streams (a
   shard's bytes from a file, a command or a URL);
3. manifest, the description of a prepared dataset (it reads other tools' FFCV files through ffcv_threads);
4. the models (drop-path per sample draws from splitmix);
5. config (the recipe);
6. what reads a recipe section: data (loaders), parallel (strategies), data_prep (conversion), trained (a finished
   run's model);
7. evaluation, the planner and cadence (the checkpoint interval), over data and strategies;
8. analysis (which evaluates);
9. train (which evaluates and analyses every epoch);
10. bench, experiments, the rehearsal and the dry run (which train);
11. cli, the command.
A new module is placed in one of them here, or this test fails; docs/architecture.md's layer table lists the same
units in the same layers (``test_the_architecture_docs_layer_table_is_layers``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "convit_scale", REPO / "data_prep")

LAYERS = [
    ["convit_scale.files", "convit_scale.entry", "convit_scale.jpeg_roi", "convit_scale.errors",
     "convit_scale.runfolder"],
    ["convit_scale.comm", "convit_scale.faults", "convit_scale.slurm_scripts", "convit_scale.hardware",
     "convit_scale.console", "convit_scale.metrics", "convit_scale.augment_policy", "convit_scale.imagetree",
     "convit_scale.ffcv_threads", "convit_scale.jpeg", "convit_scale.splitmix",
     "convit_scale.splitmix_numba", "convit_scale.streams",
     "convit_scale.gpu_wheels", "convit_scale.extensions"],
    ["convit_scale.manifest"],
    ["convit_scale.models"],
    ["convit_scale.config"],
    ["convit_scale.data", "convit_scale.parallel", "data_prep", "convit_scale.trained"],
    ["convit_scale.evaluation", "convit_scale.planner", "convit_scale.cadence"],
    ["convit_scale.analysis"],
    ["convit_scale.train"],
    ["convit_scale.bench", "convit_scale.experiments", "convit_scale.rehearsal", "convit_scale.dryrun"],
    ["convit_scale.cli"],
]
PACKAGE_FACE = "convit_scale"  # convit_scale/__init__.py re-exports the public names
COLLECTIVES = re.compile(r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather|all_gather_object|"
                         r"all_gather_into_tensor|broadcast|broadcast_object_list|barrier|reduce|reduce_scatter|"
                         r"reduce_scatter_tensor|gather|gather_object|scatter|all_to_all|send|recv)\(")


def _files() -> dict[str, Path]:
    out = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Package modules imported anywhere in the file (imports inside functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import comm` names a module
    return {m for m in found if m.split(".")[0] in ("convit_scale", "data_prep")}


def _unit(module: str) -> tuple[int, str] | None:
    """(layer, unit) of a module: the longest unit of LAYERS that is the module or a package holding it."""
    best = None
    for layer, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    return best


def _graph() -> dict[str, set[str]]:
    files = _files()
    graph = {}
    for m, p in files.items():
        deps = {i if i in files else i.rpartition(".")[0] for i in _imports(m, p)}
        graph[m] = {d for d in deps
                    if d in files and d != m and not (p.name == "__init__.py" and d.startswith(m + "."))}
    return graph


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _files() if m != PACKAGE_FACE and _unit(m) is None)
    assert not unplaced, "modules in no layer of tests/test_structure.py LAYERS: " + ", ".join(unplaced)


def _doc_layers() -> dict[int, set[str]]:
    """docs/architecture.md's layer table: the units of each layer, from its "folder / module" column (a bare name
    is under convit_scale/, as the table writes them after the first)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("\n## The layers\n", 1)[1].split("\n| --- |", 1)[1].split("\n\n", 1)[0]
    layers: dict[int, set[str]] = {}
    for row in table.strip().splitlines()[1:]:
        layer, names = (c.strip() for c in row.strip("|").split("|")[:2])
        for name in re.findall(r"`([^`]+)`", names):
            name = name.rstrip("/").removesuffix(".py")
            unit = "data_prep" if name == "data_prep" else "convit_scale." + name.removeprefix("convit_scale/")
            layers.setdefault(int(layer), set()).add(unit.replace("/", "."))
    return layers


def test_the_architecture_docs_layer_table_is_layers():
    """Every unit of LAYERS in the docs' table, in its layer, and nothing else there: with
    ``test_every_module_has_a_layer``, every module of the package has its place in the table."""
    assert _doc_layers() == {i + 1: set(units) for i, units in enumerate(LAYERS)}


def test_imports_run_only_downwards():
    upward = []
    for m, deps in _graph().items():
        if m == PACKAGE_FACE:
            continue
        layer, unit = _unit(m)
        for d in sorted(deps):
            d_layer, d_unit = _unit(d) if d != PACKAGE_FACE else (0, PACKAGE_FACE)
            if d_unit != unit and d_layer >= layer:
                upward.append(f"{m} (layer {layer + 1}) imports {d} (layer {d_layer + 1})")
    assert not upward, "imports that do not run downwards:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules_or_folders():
    graph = _graph()
    folders: dict[str, set[str]] = {}
    for m, deps in graph.items():
        here = m if (REPO / Path(*m.split("."))).is_dir() else m.rpartition(".")[0]
        folders.setdefault(here, set()).update(d if (REPO / Path(*d.split("."))).is_dir() else d.rpartition(".")[0]
                                               for d in deps)
    for name, g in (("modules", graph), ("folders", folders)):
        g = {k: {d for d in v if d != k and d in g} for k, v in g.items()}
        g = {k: {d for d in v if not d.startswith(k + ".")} for k, v in g.items()}  # a package and its own parts
        cycles = _cycles(g)
        assert not cycles, f"import cycles between {name}: " + "; ".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, done = [], set()

    def visit(node, stack, on_stack):
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, on_stack)
        on_stack.discard(node)
        stack.pop()
        done.add(node)

    for m in sorted(graph):
        if m not in done:
            visit(m, [], set())
    return cycles


def test_every_collective_goes_through_the_communication_module():
    offenders = []
    for path in _files().values():
        if path == REPO / "convit_scale" / "comm.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COLLECTIVES.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "collectives outside convit_scale/comm.py:\n" + "\n".join(offenders)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in _files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


LIGHT = ("convit_scale/__init__.py", "convit_scale/ffcv_threads.py", "convit_scale/config.py", "convit_scale/cli/",
         "convit_scale/rehearsal/run.py", "convit_scale/bench/__init__.py", "convit_scale/bench/__main__.py")
"""What the command lines import before they know the command (``--help`` answers without torch), the recipe that
the Slurm scripts read in the batch shell, and the benchmarks' dispatchers (they import only the benchmark that runs:
``bench data`` needs FFCV, the others run without it): these may import heavy modules inside functions."""
LAZY = ("deepspeed", "ffcv", "numba", "cv2", "tensorboard", "torch.utils.tensorboard", "wandb", "sklearn", "matplotlib",
        "pyarrow", "torch._dynamo", "torch.distributed.fsdp", "webdataset.gopen")
"""Libraries imported only where used, elsewhere: optional (ffcv, wandb, tensorboard, sklearn, matplotlib, pyarrow)
or costly to import for every process of a run that does not use them (deepspeed, numba; what ``parallel.preload``
imports to measure the memory baseline after them; webdataset imports torch, which a manifest read from a folder, as
prep's workers do, does not need)."""


def _top_imports(path: Path) -> set[str]:
    """The imports a module runs when imported (those in a top-level ``with importing_ffcv():`` included)."""
    out = set()
    body = ast.parse(path.read_text()).body
    for node in body + [n for w in body if isinstance(w, ast.With) for n in w.body]:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def test_imports_inside_functions_are_the_lazy_ones():
    """An import inside a function hides an arrow from a reader: only the light modules (the command line) and the
    optional or costly libraries (``LAZY``) are imported there, or a module of the package that imports one of them
    at its top (dispatch to an optional format or strategy)."""
    files = _files()
    lazy_modules = {m for m, p in files.items() if any(_is_lazy(i) for i in _top_imports(p))}
    hidden = []
    for name, path in files.items():
        rel = str(path.relative_to(REPO))
        if any(rel == light or (light.endswith("/") and rel.startswith(light)) for light in LIGHT):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mods = [".".join(base + ([node.module] if node.module else []))]
                    mods = [f"{mods[0]}.{a.name}" if f"{mods[0]}.{a.name}" in files else mods[0] for a in node.names]
                else:
                    mods = [node.module or ""]
                for m in mods:
                    if not (_is_lazy(m) or m in lazy_modules):
                        hidden.append(f"{rel}:{node.lineno} {fn.name}: {m}")
    assert not hidden, ("imports inside functions (move them to the top, or say why they are lazy):\n"
                        + "\n".join(hidden))


def _is_lazy(module: str) -> bool:
    return any(module == lib or module.startswith(lib + ".") for lib in LAZY)


RUNFOLDER = REPO / "convit_scale" / "runfolder.py"
RUNFOLDER_NAMES = ("CHECKPOINTS", "PREFIX", "META", "DAMAGED", "FAULTS", "STARTS", "HEARTBEAT", "HANGS", "LEASE",
                   "STOPPED_FOR_REQUEUE", "METRICS")
"""runfolder's names of the run folder's files that no other string of the package spells: a string equal to one of
them, or a path of them (``"hangs/x"``, a glob ``"step_*"``), is the protocol spelt a second time."""
RUNFOLDER_PARTS = ("LATEST", "BEST")
"""Names that are also ordinary words (a checkpoint's reason ``"best"``, the training state's ``best`` field): spelt
elsewhere only as a path part, an operand of ``/`` or of a path join."""
PATH_JOINS = ("joinpath", "join", "with_name", "Path", "PurePath")


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _runfolder_constants() -> dict[str, object]:
    """runfolder's constants as it assigns them (read, not imported: this test imports nothing of the package)."""
    found = {}
    for node in ast.parse(RUNFOLDER.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and all(isinstance(t, ast.Name) for t in node.targets)):
            found.update({t.id: node.value.value for t in node.targets})
    return found


def _spells_a_name(text: str, names: set[str], prefix: str, suffix: str) -> bool:
    if text in names:
        return True
    if any(c.isspace() for c in text):  # prose: a message or a help text that names a file
        return False
    parts = text.split("/")
    return any(p in names or p.endswith(suffix) or (p.startswith(prefix) and any(c in p for c in "*?[")) for p in parts)


def _path_parts(tree: ast.AST) -> list[ast.Constant]:
    """The string constants used as path parts: operands of ``/`` and arguments of a path join."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found += [n for n in (node.left, node.right) if isinstance(n, ast.Constant)]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in PATH_JOINS:
                found += [n for n in node.args if isinstance(n, ast.Constant)]
    return [n for n in found if isinstance(n.value, str)]


def test_only_the_runfolder_module_spells_the_run_folders_names():
    """One owner for the run folder's protocol (convit_scale/runfolder.py): every other module uses its constants,
    so that the ranks, the launcher's bookkeeping, the rehearsal and the tools cannot disagree on a file's name."""
    consts = _runfolder_constants()
    names = {consts[n] for n in RUNFOLDER_NAMES}
    parts = {consts[n] for n in RUNFOLDER_PARTS}
    spelt = []
    for path in _files().values():
        if path == RUNFOLDER:
            continue
        tree = _tree(path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and _spells_a_name(node.value, names, consts["PREFIX"], consts["DAMAGED"])):
                spelt.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
        spelt += [f"{path.relative_to(REPO)}:{n.lineno}: {n.value!r} (a path part)" for n in _path_parts(tree)
                  if n.value in parts]
    assert not spelt, ("the run folder's names spelt outside convit_scale/runfolder.py (use its constants):\n"
                       + "\n".join(sorted(set(spelt))))


def _is_exit(call: ast.AST) -> bool:
    f = call.func if isinstance(call, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr in ("exit", "_exit")) or (isinstance(f, ast.Name)
                                                                              and f.id == "SystemExit")


def test_only_the_runfolder_module_numbers_the_exit_statuses():
    """The exit statuses (runfolder's ``EXIT_*``) are defined there alone, and no ``main`` returns or exits with one
    of their numbers spelt out."""
    consts = _runfolder_constants()
    statuses = {v for k, v in consts.items() if k.startswith("EXIT_")}
    spelt = []
    for path in _files().values():
        if path == RUNFOLDER:
            continue
        rel = path.relative_to(REPO)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.startswith("EXIT_")
                                                    for t in node.targets):
                spelt.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
                spelt += [f"{rel}:{r.lineno}: {ast.unparse(r)}" for r in ast.walk(node) if isinstance(r, ast.Return)
                          and isinstance(r.value, ast.Constant) and r.value.value in statuses]
            elif _is_exit(node) and any(isinstance(a, ast.Constant) and a.value in statuses for a in node.args):
                spelt.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not spelt, ("exit statuses spelt outside convit_scale/runfolder.py (use its EXIT_*):\n"
                       + "\n".join(sorted(spelt)))


def _top_level_definitions(path: Path) -> set[str]:
    """Names a file defines itself at its top level (functions, classes, assignments; not imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _global_names(code) -> set[str]:
    """The names a function's code (nested code objects included) looks up, globals among them."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def test_numba_cached_functions_use_nothing_from_other_files():
    """Numba checks a cached function (``cache=True``) against its own file only: one that calls a function or reads
    a constant of another file keeps the stale compiled code when that file changes, and the loaders would draw
    crops or resize with the old code. So a cached function uses modules and what its own file defines, and the
    same holds for every function of its file it calls."""
    import importlib
    import inspect
    import types

    cached_files = {m: p for m, p in _files().items() if "cache=CACHE" in p.read_text()}
    assert {"convit_scale.splitmix_numba", "convit_scale.data.resample"} <= set(cached_files)
    fixed = [m for m, p in _files().items() if re.search(r"@(?:numba\.)?njit\([^)]*cache=True", p.read_text())]
    assert not fixed, f"{fixed}: cache=True fails the import where no cache folder is writable; cache=CACHE"
    wrong, seen = [], 0
    for name, path in cached_files.items():
        module = importlib.import_module(name)
        own = _top_level_definitions(path)
        todo = [f for f in vars(module).values()  # numba's dispatchers of cache=True hold a FunctionCache
                if type(getattr(f, "_cache", None)).__name__ == "FunctionCache" and f.__module__ == name]
        seen += len(todo)
        done = set()
        while todo:
            fn = todo.pop()
            py_func = getattr(fn, "py_func", fn)
            if py_func in done:
                continue
            done.add(py_func)
            for ref in _global_names(py_func.__code__) & set(py_func.__globals__):
                value = py_func.__globals__[ref]
                if isinstance(value, types.ModuleType):
                    continue
                if ref not in own:
                    wrong.append(f"{name}.{py_func.__name__} uses {ref}, which its file imports")
                elif inspect.isfunction(getattr(value, "py_func", value)):
                    todo.append(value)
    assert seen >= 10 and not wrong, wrong
