"""No import circles between kvserve's top-level packages, and imports that only point down.

The graph: one node per top-level package or module of kvserve (`kvserve/core/` -> "core",
`kvserve/config.py` -> "config"); an arrow A -> B for every import in A of something in B, read
with `ast`: module-level imports and imports inside functions alike (a lazy import is still a
dependency; it only hides it from the import system). Not counted: imports under
`if TYPE_CHECKING:`, which never run and only name a type for an annotation. `from kvserve
import LLM` is resolved through the root package's lazy export table to the module that defines
the name (kvserve/__init__.py itself imports nothing).

The layers, lowest first; an import goes from a higher layer to a strictly lower one, and the
packages of one layer do not import each other:

    envs, json_config, sampling_params, outputs,  settings and plain data types;
    utils                                          process set-up (allocator, oneDNN cache)
    ops, metrics                                   compiled kernels; counters and stat loggers
    config                                         the resolved engine configuration
    distributed, attention, sample                 process groups; attention backends; sampler
    model                                          layers, architectures, loaders (GGUF too)
    tokenizer                                      (builds GGUF tokenizers from model/'s reader)
    core                                           requests, KV blocks, the scheduler, messages
    structured_output, kv_transfer, spec_decode    features: scheduler- and worker-side parts
    worker                                         model runner, input batch
    executor                                       uni / multiproc / Ray
    engine                                         engine core, clients, frontend processing
    entrypoints                                    LLM, the OpenAI server, `kvserve serve` ...
    benchmarks                                     drive LLM and the server
    __main__                                       the `kvserve` command (entrypoints + bench)

So core does not import the features it schedules (the engine hands the scheduler their hooks),
config takes GGUF data from model/ as plain dicts, and attention backends know no model layer.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict
from typing import Optional

import kvserve

PACKAGE_DIR = os.path.dirname(kvserve.__file__)

LAYERS: tuple[tuple[str, ...], ...] = (
    ("envs", "json_config", "sampling_params", "outputs", "utils"),
    ("ops", "metrics"),
    ("config",),
    ("distributed", "attention", "sample"),
    ("model",),
    ("tokenizer",),
    ("core",),
    ("structured_output", "kv_transfer", "spec_decode"),
    ("worker",),
    ("executor",),
    ("engine",),
    ("entrypoints",),
    ("benchmarks",),
    ("__main__",),
)
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# (from package, to package) -> ["path:line", ...]
Graph = dict[tuple[str, str], list[str]]


def _top_level_names() -> set[str]:
    names = set()
    for entry in os.listdir(PACKAGE_DIR):
        path = os.path.join(PACKAGE_DIR, entry)
        if entry.endswith(".py") and entry != "__init__.py":
            names.add(entry[:-3])
        elif os.path.isdir(path) and any(f.endswith(".py") for f in os.listdir(path)):
            names.add(entry)                  # a package, with or without __init__.py
    return names


def _root_exports() -> dict[str, str]:
    """kvserve/__init__.py's lazy table: public name -> defining module."""
    tree = ast.parse(open(os.path.join(PACKAGE_DIR, "__init__.py")).read())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                 for t in node.targets)):
            return ast.literal_eval(node.value)
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute dotted names an import statement (or import_module("...") call) reaches."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + is_package]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        return [f"{target}.{a.name}" for a in node.names] if target == "kvserve" else [target]
    if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
            == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _walk_runtime(node: ast.AST):
    """Every node below `node` except the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _walk_runtime(stmt)
            continue
        yield child
        yield from _walk_runtime(child)


def build_graph(package_dir: str = PACKAGE_DIR) -> Graph:
    names, exports = _top_level_names(), _root_exports()

    def top_level(dotted: str) -> Optional[str]:
        parts = dotted.split(".")
        if parts[0] != "kvserve" or len(parts) < 2:
            return None
        if parts[1] in names:
            return parts[1]
        defining = exports.get(parts[1])      # `from kvserve import LLM`
        return defining.split(".")[1] if defining else None

    graph: Graph = defaultdict(list)
    for dirpath, _, files in os.walk(package_dir):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, file)
            rel = os.path.relpath(path, os.path.dirname(package_dir))
            module = rel[:-3].replace(os.sep, ".")
            is_package = module.endswith(".__init__")
            module = module[: -len(".__init__")] if is_package else module
            source = top_level(module)
            if source is None:
                continue                      # kvserve/__init__.py: imports nothing of ours
            tree = ast.parse(open(path).read(), path)
            for node in _walk_runtime(tree):
                for target in _imported_modules(node, module, is_package):
                    dest = top_level(target)
                    if dest is not None and dest != source:
                        graph[(source, dest)].append(f"{rel}:{node.lineno}")
    return dict(graph)


def find_cycle(graph: Graph) -> Optional[list[str]]:
    """One cycle of packages (first == last), or None."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(graph):
        succ[a].append(b)
    state: dict[str, int] = {}             # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in succ[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(succ):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _where(graph: Graph, a: str, b: str) -> str:
    sites = graph[(a, b)]
    return f"{a} -> {b} ({', '.join(sites[:3])}{', ...' if len(sites) > 3 else ''})"


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = build_graph()
    cycle = find_cycle(graph)
    assert cycle is None, ("import cycle between kvserve's top-level packages: "
                           + " -> ".join(cycle) + "\n  "
                           + "\n  ".join(_where(graph, a, b) for a, b in zip(cycle, cycle[1:])))


def test_every_top_level_package_has_a_layer() -> None:
    missing = sorted(_top_level_names() - set(LAYER_OF))
    assert not missing, (f"place {missing} in LAYERS (tests/test_import_graph.py) and in the "
                         f"docstring's table")


def test_imports_point_down_the_layers() -> None:
    graph = build_graph()
    wrong = [_where(graph, a, b) for a, b in sorted(graph)
             if a in LAYER_OF and b in LAYER_OF and LAYER_OF[a] <= LAYER_OF[b]]
    assert not wrong, ("imports that do not point to a lower layer (see LAYERS in "
                       "tests/test_import_graph.py):\n  " + "\n  ".join(wrong))
