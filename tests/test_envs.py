"""minivllm.envs: every switch typed, defaulted, read when used, aliased to vLLM's names;
no other module reads a MINIVLLM_ variable itself; the README's table mirrors it."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from minivllm import envs

PACKAGE = pathlib.Path(envs.__file__).parent
README = PACKAGE.parent / "README.md"


@pytest.fixture
def clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
        if var.vllm_alias:
            monkeypatch.delenv(var.vllm_alias, raising=False)
    return monkeypatch


def test_defaults_and_types(clean_env):
    clean_env.setenv("HOME", "/home/someone")
    assert envs.MINIVLLM_CPU_KVCACHE_SPACE == 4.0
    assert envs.MINIVLLM_CPU_OMP_THREADS_BIND == "auto"
    for name in (
        "MINIVLLM_ENABLE_MULTIPROCESSING",
        "MINIVLLM_CPU_PACKED_LINEAR",
        "MINIVLLM_CPU_SMALL_BATCH_LINEAR",
        "MINIVLLM_CPU_ATTN_KERNEL",
        "MINIVLLM_CPU_LAYER_KERNELS",
        "MINIVLLM_CPU_GRAPHS",
        "MINIVLLM_CPU_REUSE_FREED_MEMORY",
    ):
        assert getattr(envs, name) is True, name
    assert envs.MINIVLLM_CACHE_DIR == "/home/someone/.cache/minivllm"
    assert envs.MINIVLLM_API_KEY is None


def test_values_are_read_when_used(clean_env):
    clean_env.setenv("MINIVLLM_CPU_KVCACHE_SPACE", "0.5")
    assert envs.MINIVLLM_CPU_KVCACHE_SPACE == 0.5
    clean_env.setenv("MINIVLLM_CPU_KVCACHE_SPACE", "2")
    assert envs.MINIVLLM_CPU_KVCACHE_SPACE == 2.0
    clean_env.setenv("MINIVLLM_API_KEY", "k")
    assert envs.MINIVLLM_API_KEY == "k"
    clean_env.setenv("MINIVLLM_CACHE_DIR", "~/elsewhere")
    assert envs.MINIVLLM_CACHE_DIR == os.path.expanduser("~/elsewhere")


@pytest.mark.parametrize(
    "raw, expected",
    [("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("on", True)],
)
def test_booleans(clean_env, raw, expected):
    clean_env.setenv("MINIVLLM_CPU_ATTN_KERNEL", raw)
    assert envs.MINIVLLM_CPU_ATTN_KERNEL is expected


def test_an_empty_value_means_the_default(clean_env):
    clean_env.setenv("MINIVLLM_CPU_PACKED_LINEAR", " ")
    assert envs.MINIVLLM_CPU_PACKED_LINEAR is True


@pytest.mark.parametrize(
    "name, raw",
    [
        ("MINIVLLM_ENABLE_MULTIPROCESSING", "maybe"),
        ("MINIVLLM_CPU_KVCACHE_SPACE", "0"),
        ("MINIVLLM_CPU_KVCACHE_SPACE", "-1"),
        ("MINIVLLM_CPU_KVCACHE_SPACE", "lots"),
    ],
)
def test_bad_values_are_refused_with_the_name(clean_env, name, raw):
    clean_env.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)


def test_vllm_names_are_aliases_when_ours_is_unset(clean_env):
    clean_env.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert envs.MINIVLLM_CPU_KVCACHE_SPACE == 3.0
    assert envs.MINIVLLM_CPU_OMP_THREADS_BIND == "0-1"
    clean_env.setenv("MINIVLLM_CPU_KVCACHE_SPACE", "1")
    clean_env.setenv("MINIVLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert envs.MINIVLLM_CPU_KVCACHE_SPACE == 1.0
    assert envs.MINIVLLM_CPU_OMP_THREADS_BIND == "nobind"


def test_the_kv_cache_default_follows_the_vllm_name(clean_env):
    from minivllm.platforms.cpu import cpu_kv_cache_bytes_default

    clean_env.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert cpu_kv_cache_bytes_default() == 1 << 29


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        envs.MINIVLLM_NO_SUCH_SWITCH  # noqa: B018
    assert sorted(var.name for var in envs.VARIABLES) == dir(envs)


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every os.environ / os.getenv read of a literal name in a module."""

    def is_environ(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "environ"
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            reads = isinstance(func, ast.Attribute) and (
                (is_environ(func.value) and func.attr in ("get", "setdefault", "pop"))
                or (func.attr == "getenv" and isinstance(func.value, ast.Name))
            )
            key = node.args[0] if reads else None
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append((node.lineno, key.value))
    return found


def test_only_envs_reads_our_variables():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
            if name.startswith(("MINIVLLM_", "VLLM_")):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} {name}")
    assert offenders == []


def test_the_scan_sees_a_direct_read():
    planted = 'import os\nx = os.environ.get("MINIVLLM_X", "1")\ny = "MINIVLLM_Y" in os.environ\n'
    names = [name for _, name in _environment_reads(ast.parse(planted))]
    assert names == ["MINIVLLM_X", "MINIVLLM_Y"]


def readme_row(var: envs.EnvVar) -> str:
    alias = f" (vLLM: `{var.vllm_alias}`)" if var.vllm_alias else ""
    default = "unset" if var.default is None else f"`{var.default}`"
    doc = var.doc.replace("|", "\\|")
    return f"| `{var.name}`{alias} | {default} | {doc} |"


def test_readme_table_mirrors_envs():
    text = README.read_text()
    table = text[text.index("## Environment variables") :]
    table = table[: table.index("\n## ")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows == [readme_row(var) for var in envs.VARIABLES]
