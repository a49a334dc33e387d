"""The package's layering, checked by reading its source (AST), never by importing it:

- ``core/`` imports no torch, neither itself nor through the package modules it imports
  at module level (a lazy import inside a function is a deliberate choice, and is allowed
  only outside ``core/``);
- ``model/`` imports nothing of ``engine/`` or ``core/``;
- nothing imports ``entrypoints/`` but the entry points themselves (the CLI among them).
- only ``platforms/`` asks which device it runs on (everything else asks the platform);
- ``config.py`` (the frozen configs) imports nothing of the package but ``envs``, and under
  ``engine/`` only ``create_config`` imports ``model/`` (lazy imports count for both);
- no import cycle among the package's modules. Module-level imports count, and importing
  ``a.b.c`` loads ``a`` and ``a.b`` too; a lazy import (inside a function) does not: it runs
  when called, after every module has loaded, so it never meets a half-initialized one
  (it is how a module reaches back, e.g. a factory naming its subclasses). TYPE_CHECKING
  imports never run and count nowhere.

Each rule is a function over a source tree, so the tests also plant a violation in a
small tree of their own and check that it is reported.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import minivllm

PACKAGE = pathlib.Path(minivllm.__file__).parent


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. minivllm.core.scheduler
    target: str  # what it imports, e.g. minivllm.engine.messages
    line: int
    module_level: bool  # not inside a function (TYPE_CHECKING blocks count as not at all)

    def where(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: pathlib.Path, root: pathlib.Path) -> list[Import]:
    """Every import in one file, with the names it reaches (``from a import b``: a and a.b)."""
    module = _module_name(path, root)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # never runs
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, child.lineno, module_level))
            elif isinstance(child, ast.ImportFrom):
                source = _resolve(module, is_package, child)
                found.append(Import(module, source, child.lineno, module_level))
                for alias in child.names:
                    if alias.name != "*":
                        target = f"{source}.{alias.name}"
                        found.append(Import(module, target, child.lineno, module_level))
            inner = module_level and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def all_imports(root: pathlib.Path) -> dict[str, list[Import]]:
    """Module name -> its imports, for every module of the package at ``root``."""
    return {_module_name(path, root): imports_of(path, root) for path in sorted(root.rglob("*.py"))}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _closest_module(name: str, modules: dict[str, list[Import]]) -> str | None:
    """The package module an import names (``from a import f``: a.f is no module, a is)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(name: str, modules: dict[str, list[Import]]) -> list[str]:
    parts = name.split(".")
    return [m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in modules]


def torch_in_core(root: pathlib.Path) -> list[str]:
    pkg = root.name
    modules = all_imports(root)
    problems = []
    for start in (m for m in modules if _within(m, f"{pkg}.core")):
        # Walk the package modules ``start`` loads when it is imported.
        seen, stack, path_to = {start}, [start], {start: [start]}
        while stack:
            current = stack.pop()
            for imp in modules[current]:
                direct = current == start
                if not (imp.module_level or direct):
                    continue
                if _within(imp.target, "torch"):
                    chain = " -> ".join(path_to[current])
                    problems.append(f"{chain}: line {imp.line} imports {imp.target}")
                    continue
                inner = _closest_module(imp.target, modules) if _within(imp.target, pkg) else None
                if inner is None or not imp.module_level:
                    continue
                # Importing a.b.c runs a/__init__ and a/b/__init__ first.
                for loaded in _with_parents(inner, modules):
                    if loaded not in seen:
                        seen.add(loaded)
                        path_to[loaded] = path_to[current] + [loaded]
                        stack.append(loaded)
    return sorted(set(problems))


def model_imports_engine_or_core(root: pathlib.Path) -> list[str]:
    pkg = root.name
    return [
        imp.where()
        for module, imps in all_imports(root).items()
        if _within(module, f"{pkg}.model")
        for imp in imps
        if _within(imp.target, f"{pkg}.engine") or _within(imp.target, f"{pkg}.core")
    ]


def entrypoints_imported_from_outside(root: pathlib.Path) -> list[str]:
    pkg = root.name
    return [
        imp.where()
        for module, imps in all_imports(root).items()
        if not _within(module, f"{pkg}.entrypoints")
        for imp in imps
        if _within(imp.target, f"{pkg}.entrypoints")
    ]


def imports_outside(root: pathlib.Path, module: str, allowed: tuple[str, ...]) -> list[str]:
    """The package modules ``module`` imports (lazily too) that are not within ``allowed``."""
    pkg = root.name
    return [
        imp.where()
        for imp in all_imports(root).get(f"{pkg}.{module}", [])
        if _within(imp.target, pkg)
        and imp.target != pkg  # ``from minivllm import envs`` names the package itself
        and not any(_within(imp.target, f"{pkg}.{a}") for a in allowed)
    ]


def engine_imports_of_model(root: pathlib.Path) -> list[str]:
    pkg = root.name  # the config-creation module is the engine's one way to the model
    return [
        imp.where()
        for module, imps in all_imports(root).items()
        if _within(module, f"{pkg}.engine") and module != f"{pkg}.engine.create_config"
        for imp in imps
        if _within(imp.target, f"{pkg}.model")
    ]


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package modules importing it loads (module-level imports)."""
    pkg = root.name
    modules = all_imports(root)
    graph: dict[str, set[str]] = {}
    for module, imps in modules.items():
        ancestors = set(_with_parents(module, modules))  # loaded before it, in any case
        graph[module] = {
            loaded
            for imp in imps
            if imp.module_level and _within(imp.target, pkg)
            for loaded in _with_parents(_closest_module(imp.target, modules) or pkg, modules)
            if loaded not in ancestors
        }
    return graph


def import_cycles(root: pathlib.Path) -> list[str]:
    """One cycle through each group of modules that import each other, as "a -> b -> a"."""
    graph = import_graph(root)
    cycles, done = [], set()
    for start in sorted(graph):
        # Depth-first from ``start``, only into modules no earlier start has explored.
        path, on_path, stack = [start], {start}, [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                on_path.discard(path.pop())
                stack.pop()
            elif nxt in on_path:
                cycle = path[path.index(nxt) :] + [nxt]
                if not done.intersection(cycle):
                    cycles.append(" -> ".join(cycle))
                    done.update(cycle)
            elif nxt not in done and nxt not in path:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
        done.add(start)
    return cycles


# ---------------------------------------------------------------------- the package


def test_core_imports_no_torch():
    assert torch_in_core(PACKAGE) == []


def test_model_imports_nothing_of_engine_or_core():
    assert model_imports_engine_or_core(PACKAGE) == []


def test_only_entrypoints_import_entrypoints():
    assert entrypoints_imported_from_outside(PACKAGE) == []


def test_config_imports_nothing_of_the_package_but_envs():
    assert imports_outside(PACKAGE, "config", allowed=("envs",)) == []


def test_only_create_config_imports_model_under_engine():
    assert engine_imports_of_model(PACKAGE) == []


def test_no_import_cycle():
    assert import_cycles(PACKAGE) == []


# ---------------------------------------------------------------------- planted violations


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "minivllm"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_torch_in_core_is_reported_direct_and_through_another_module(tmp_path):
    root = _plant(
        tmp_path,
        {
            "core/direct.py": "import torch.nn\n",
            "core/indirect.py": "from minivllm.sample import helper\n",
            "core/lazy_elsewhere.py": "from minivllm.tools.lazy import f\n",
            "core/fine.py": "import typing\nif typing.TYPE_CHECKING:\n    import torch\n",
            "sample/helper.py": "import os\n",
            "sample/__init__.py": "from torch import nn\n",
            "tools/lazy.py": "def f():\n    import torch\n",
        },
    )
    assert torch_in_core(root) == [
        "minivllm.core.direct: line 1 imports torch.nn",
        "minivllm.core.indirect -> minivllm.sample: line 1 imports torch",
        "minivllm.core.indirect -> minivllm.sample: line 1 imports torch.nn",
    ]


def test_a_lazy_torch_import_inside_core_is_still_reported(tmp_path):
    root = _plant(tmp_path, {"core/sneaky.py": "def f():\n    import torch\n"})
    assert torch_in_core(root) == ["minivllm.core.sneaky: line 2 imports torch"]


def test_model_importing_engine_or_core_is_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "model/a.py": "from minivllm.engine.messages import X\n",
            "model/b.py": "def f():\n    from ..core import scheduler\n",
            "model/c.py": "from minivllm.distributed import parallel_state\n",
        },
    )
    assert model_imports_engine_or_core(root) == [
        "minivllm.model.a:1 imports minivllm.engine.messages",
        "minivllm.model.a:1 imports minivllm.engine.messages.X",
        "minivllm.model.b:2 imports minivllm.core",
        "minivllm.model.b:2 imports minivllm.core.scheduler",
    ]


def test_importing_entrypoints_from_outside_is_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "engine/a.py": "from minivllm import entrypoints\n",
            "entrypoints/cli.py": "from minivllm.entrypoints.openai import api_server\n",
            "entrypoints/openai/api_server.py": "from ..llm import LLM\n",
        },
    )
    assert entrypoints_imported_from_outside(root) == [
        "minivllm.engine.a:1 imports minivllm.entrypoints"
    ]


def test_config_and_engine_imports_are_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "config.py": "from minivllm import envs\ndef f():\n    from minivllm.model import x\n",
            "engine/create_config.py": "from minivllm.model.loader import load\n",
            "engine/core.py": "def f():\n    from ..model import registry\n",
        },
    )
    assert imports_outside(root, "config", allowed=("envs",)) == [
        "minivllm.config:3 imports minivllm.model",
        "minivllm.config:3 imports minivllm.model.x",
    ]
    assert engine_imports_of_model(root) == [
        "minivllm.engine.core:2 imports minivllm.model",
        "minivllm.engine.core:2 imports minivllm.model.registry",
    ]


def test_an_import_cycle_is_reported_and_lazy_or_type_checking_imports_close_none(tmp_path):
    root = _plant(
        tmp_path,
        {
            "config.py": "from minivllm.layers import quant\n",
            "layers/quant.py": "from minivllm.kernels.ops import gemm\n",
            "kernels/ops.py": "import minivllm.platforms.cpu\n",
            "platforms/__init__.py": "from minivllm.config import DEVICES\n",
            "platforms/cpu.py": "X = 1\n",
            "executor/base.py": "def make():\n    from minivllm.executor import uni\n",
            "executor/uni.py": "from minivllm.executor.base import make\n",
            "worker/a.py": "if TYPE_CHECKING:\n    import minivllm.worker.b\n",
            "worker/b.py": "from minivllm.worker import a\n",
        },
    )
    # kernels.ops loads platforms/__init__ (the package of platforms.cpu), which imports config.
    assert import_cycles(root) == [
        "minivllm.config -> minivllm.layers.quant -> minivllm.kernels.ops -> minivllm.platforms"
        " -> minivllm.config"
    ]


# ---------------------------------------------------------------------- device branches

DEVICE_NAMES = ("cpu", "cuda", "mps", "xpu", "hpu", "tpu")


def _is_device_name(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.partition(":")[0] in DEVICE_NAMES
    )


def _is_device_value(node: ast.AST) -> bool:
    """``device``, ``x.device``, ``x.device.type``, ``x.device_type`` and the like."""
    if isinstance(node, ast.Attribute) and node.attr == "type":
        node = node.value
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return isinstance(name, str) and (
        name == "device" or name.endswith("_device") or name == "device_type"
    )


def device_branches(root: pathlib.Path) -> list[str]:
    """Where code outside ``platforms/`` asks which device it runs on: a comparison with a
    device name or with a device (``x.device.type == ...``, ``device != ...``),
    ``.startswith("cuda")``, ``.is_cuda`` / ``.is_cpu``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] == "platforms":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            hit = False
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                hit = any(_is_device_name(o) for o in operands) or any(
                    _is_device_value(o) for o in operands
                )
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = node.func.attr == "startswith" and any(_is_device_name(a) for a in node.args)
            elif isinstance(node, ast.Attribute):
                hit = node.attr in ("is_cuda", "is_cpu")
            if hit:
                found.append(f"{rel}:{node.lineno}")
    return found


def test_only_platforms_branch_on_the_device():
    assert device_branches(PACKAGE) == []


def test_device_branches_are_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "worker/a.py": (
                "if x.device.type == 'cuda':\n    pass\n"
                "if device != 'cpu':\n    pass\n"
                "on_gpu = config.device.startswith('cuda')\n"
                "if t.is_cuda:\n    pass\n"
                "same = a.device == b.device\n"
                "y = torch.zeros(3, device='cpu')\n"  # placing a tensor is no branch
                "kind = 'cpu'\n"
            ),
            "platforms/cuda.py": "if device == 'cuda':\n    pass\n",
        },
    )
    assert device_branches(root) == [
        "minivllm/worker/a.py:1",
        "minivllm/worker/a.py:3",
        "minivllm/worker/a.py:5",
        "minivllm/worker/a.py:6",
        "minivllm/worker/a.py:8",
    ]


# ---------------------------------------------------------------------- package docstrings


def packages_without_a_one_line_docstring(root: pathlib.Path) -> list[str]:
    """Every package says in one line what it owns: its ``__init__``'s docstring."""
    missing = []
    for init in sorted(root.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(), str(init)))
        if not doc or "\n" in doc.strip():
            missing.append(str(init.parent.relative_to(root.parent)))
    return missing


def test_every_package_says_in_one_line_what_it_owns():
    assert packages_without_a_one_line_docstring(PACKAGE) == []


def test_a_package_without_one_is_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "good/__init__.py": '"""Owns this."""\n',
            "long/__init__.py": '"""Owns this.\n\nAnd more."""\n',
        },
    )
    (root / "__init__.py").write_text('"""The package."""\n')
    assert packages_without_a_one_line_docstring(root) == ["minivllm/long"]


# ---------------------------------------------------------------------- the README's layout


def packages_missing_from_readme(root: pathlib.Path, readme: str) -> list[str]:
    """Every package (a folder with an ``__init__``) is named in the README's layout block,
    as ``name/`` (top level) or ``parent/name/``-style text somewhere in it."""
    block = readme[readme.index("## Layout") :]
    block = block[: block.index("```", block.index("```") + 3)]
    missing = []
    for init in sorted(root.glob("*/__init__.py")):
        name = init.parent.name
        if f"{name}/" not in block:
            missing.append(name)
    return missing


def test_readme_layout_names_every_package():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert packages_missing_from_readme(PACKAGE, readme) == []


def test_a_package_missing_from_the_layout_is_reported(tmp_path):
    root = _plant(tmp_path, {"core/a.py": "", "newpkg/b.py": ""})
    readme = "## Layout\n\n```\nminivllm/\n  core/   the scheduler\n```\n"
    assert packages_missing_from_readme(root, readme) == ["newpkg"]
