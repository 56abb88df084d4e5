"""The packages' import graph: the engine's layers point one way, nothing imports in a circle, the
engine reaches the store through its public names only, and ``import engine`` loads no integration
and no optional dependency.

Every ``import`` statement counts, at module level, inside functions and under ``TYPE_CHECKING``
alike: a lazy import is still a dependency. Read from the source with ``ast``, never imported.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The engine's layers, lowest first: a module may import from its own layer's package and from the
#: layers below it, never above. A module's layer is the longest of these prefixes it falls under.
LAYERS = [
    ["engine.errors"],
    ["engine.config", "engine.stats"],
    ["engine.io"],
    ["engine.extensions"],
    ["engine.paging"],
    ["engine.optim"],
    ["engine.checkpoint"],
    ["engine.engine"],
    ["engine.integrations.deepspeed"],
    ["engine.integrations.hf"],
    ["engine.integrations", "engine.demo"],
    ["engine"],
    ["engine.cli"],
]

#: Imports allowed to point up the layers or to close a cycle: (importer, imported) -> why.
ALLOWED: dict[tuple[str, str], str] = {}

#: What the engine may import from the store: its package root and these documented public modules.
TIERED_PUBLIC_MODULES = ("tiered", "tiered.util", "tiered.cli")

#: What ``import engine`` must not load: the integrations and every optional dependency.
OPTIONAL = ("transformers", "accelerate", "peft", "safetensors", "deepspeed", "huggingface_hub", "tensorboard",
            "wandb", "comet_ml", "matplotlib", "yaml")


def modules(package: str) -> dict[str, str]:
    """Dotted module name -> file, for every module of ``package`` (a directory under ROOT)."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str) -> Iterator[tuple[str, Optional[str], int]]:
    """(module, imported name or None, line) for every import statement in the file, anywhere in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield base, alias.name, node.lineno


def engine_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported engine module: line} (``from pkg import mod`` counts as importing pkg.mod)."""
    mods = modules("engine")
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        for module, item, line in imports(name, path):
            if module != "engine" and not module.startswith("engine."):
                continue
            target = f"{module}.{item}" if item and f"{module}.{item}" in mods else module
            if target != name:
                edges.setdefault(target, line)
    return graph


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the LAYERS prefix the module falls under)."""
    best = (-1, "")
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    assert best[0] >= 0, f"{module} is in no layer: add its package to LAYERS"
    return best


def test_every_engine_module_is_in_a_layer():
    for module in engine_graph():
        layer_of(module)


def test_engine_imports_point_down_the_layers():
    upward = []
    for importer, targets in engine_graph().items():
        own, own_prefix = layer_of(importer)
        for target, line in targets.items():
            index, prefix = layer_of(target)
            if (index > own or (index == own and prefix != own_prefix)) and (importer, target) not in ALLOWED:
                upward.append(f"{importer}:{line} imports {target} (layer {prefix}, above {own_prefix})")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, {})))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_the_engine():
    graph = {importer: {t: line for t, line in targets.items() if (importer, t) not in ALLOWED}
             for importer, targets in engine_graph().items()}
    cycles = strongly_connected(graph)
    assert not cycles, "modules importing each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b": 1}, "b": {}}) == []


def test_the_engine_uses_only_the_stores_public_names():
    public = {}
    for module in TIERED_PUBLIC_MODULES:
        path = os.path.join(ROOT, *module.split("."))
        path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        assert names, f"{module} has no __all__"
        public[module] = set(ast.literal_eval(names[0]))
    private = []
    for name, path in modules("engine").items():
        for module, item, line in imports(name, path):
            if module != "tiered" and not module.startswith("tiered."):
                continue
            if module not in public or (item is not None and item not in public[module]):
                private.append(f"{name}:{line} imports {module}" + (f".{item}" if item else ""))
    assert not private, "the engine imports names the store does not export:\n" + "\n".join(private)


def test_the_store_never_imports_the_engine():
    found = [f"{name}:{line} imports {module}" for name, path in modules("tiered").items()
             for module, _, line in imports(name, path) if module == "engine" or module.startswith("engine.")]
    assert not found, "\n".join(found)


#: Most modules ``tiered/`` keeps at its root (``__init__.py`` included): the public surface and the
#: commands; everything else lives in the package of its part (store, manifest, io, util, ...).
TIERED_ROOT_MODULES = 10


def test_the_stores_root_holds_only_its_surface():
    root = sorted(f for f in os.listdir(os.path.join(ROOT, "tiered")) if f.endswith(".py"))
    assert len(root) <= TIERED_ROOT_MODULES, f"tiered/ holds {len(root)} modules at its root: {root}"


def imports_outside_type_checking(name: str, path: str) -> Iterator[tuple[str, int]]:
    """(module, line) for every import statement in the file, except under ``if TYPE_CHECKING:``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for child in node.body for n in ast.walk(child)}
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base, node.lineno


def test_the_stores_parts_never_import_its_facade():
    """Below ``tiered.store.tiered_store`` the parts take what they work on; none knows the facade
    (a type-only import excepted), and the facade is the only one that builds them all."""
    facade = ("tiered.store.tiered_store", "tiered.store")
    found = [f"{name}:{line} imports {module}" for name, path in modules("tiered").items()
             if name.startswith("tiered.store.") and name != "tiered.store.tiered_store"
             for module, line in imports_outside_type_checking(name, path) if module in facade]
    assert not found, "\n".join(found)


def loaded_after(statement: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_import_engine_loads_no_integration_and_no_optional_dependency():
    loaded = loaded_after("import engine; engine.wrap")  # the core's names come in together on first use
    assert "engine.engine" in loaded  # the check sees what it should
    integrations = [m for m in loaded if m.startswith("engine.integrations") or m.startswith("engine.cli")]
    optional = [m for m in loaded if m.split(".")[0] in OPTIONAL]
    assert not integrations and not optional, (integrations, optional)


def test_the_command_line_loads_no_torch_until_a_command_runs():
    """``tiered --help``, ``--version`` and the dispatch import neither torch nor the engine's core, so they
    answer at once; ``import tiered`` and ``import engine`` load their names on first use."""
    loaded = loaded_after("import tiered, engine, engine.cli, engine.cli.main, tiered.cli")
    assert "engine.cli.main" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "torch" or m == "engine.engine"], loaded


@pytest.mark.parametrize("names, module", [
    (("AdamW", "DeepSpeedEngine", "Engine", "EngineClosedError", "EngineConfig", "EngineStats", "LossScaling",
      "MemoryEstimate", "OverflowAwareScheduler", "ReleasedParameterError", "ShardLayout", "add_config_arguments",
      "checkpoint_state_dict", "estimate_memory", "export_checkpoint", "from_pretrained",
      "import_deepspeed_checkpoint", "init_distributed", "initialize", "load_checkpoint_and_dispatch", "param_key",
      "wrap", "EngineError", "CheckpointError"), "engine"),
    (("EngineTrainer", "EngineCheckpointCallback", "lora_init", "peft_base_weights",
      "deepspeed_config_from_accelerate", "register_engine_state", "from_pretrained",
      "load_checkpoint_and_dispatch"), "engine.integrations.hf"),
    (("DeepSpeedEngine", "optimizer_from_deepspeed", "scheduler_from_deepspeed", "WarmupLR", "WarmupDecayLR",
      "WarmupCosineLR", "import_deepspeed_checkpoint"), "engine.integrations.deepspeed"),
    (("initialize", "add_config_arguments"), "engine.integrations.deepspeed.initialize"),
])
def test_the_documented_names_are_reachable(names, module):
    found = importlib.import_module(module)
    missing = [name for name in names if not hasattr(found, name)]
    assert not missing, f"{module} lacks {missing}"


def test_every_cited_note_exists_once():
    """A ``[Note: Title]`` cited anywhere in the packages is defined exactly once, beside the code it
    explains: by a ``# [Note: Title]`` comment block, or by a module docstring's paragraph that opens
    with ``[Note: Title]`` on a line of its own."""
    defined: dict[str, list[str]] = {}
    cited: dict[str, str] = {}
    for package in ("engine", "tiered"):
        for name, path in modules(package).items():
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    for title in re.findall(r"\[Note: ([^\]]+)\]", line):
                        if line.strip() in (f"# [Note: {title}]", f"[Note: {title}]"):
                            defined.setdefault(title, []).append(f"{name}:{number}")
                        else:
                            cited.setdefault(title, f"{name}:{number}")
    assert defined, "no note found: the scan is broken"
    assert not {t: w for t, w in defined.items() if len(w) > 1}, "notes defined twice"
    missing = {title: where for title, where in cited.items() if title not in defined}
    assert not missing, f"cited notes that no comment block defines: {missing}"


@pytest.mark.parametrize("package", ["tiered", "tiered.util", "engine"])
def test_each_public_name_loads_from_the_module_its_package_names(package):
    """The packages import their public names on first use, from a table: every name of ``__all__`` is
    in it, resolves, and loads no optional dependency beyond its own (in a fresh process)."""
    code = (f"import importlib; m = importlib.import_module({package!r}); "
            "missing = [n for n in m.__all__ if n not in m._HOMES and n not in vars(m)]; "
            "assert not missing, missing; [getattr(m, n) for n in m.__all__ if n in m._HOMES and "
            "not n.startswith(('initialize', 'add_config', 'DeepSpeed', 'import_deepspeed', 'from_pretrained', "
            "'load_checkpoint_and'))]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
