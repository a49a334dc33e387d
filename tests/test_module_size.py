"""No module of the package grows past 500 lines (issue 48): a module that does is owning
more than one thing. The protocol models (one pydantic class per API object) and the
kernels' C sources are exempt."""

from __future__ import annotations

from pathlib import Path

import minivllm

MAX_LINES = 500
PACKAGE = Path(minivllm.__file__).parent
EXEMPT = {"entrypoints/openai/protocol.py"}


def module_lengths(root: Path) -> dict[str, int]:
    return {
        path.relative_to(root).as_posix(): len(path.read_text().splitlines())
        for path in root.rglob("*.py")
    }


def test_no_module_over_the_limit():
    lengths = module_lengths(PACKAGE)
    assert "core/scheduler.py" in lengths  # the walk sees the package
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in EXEMPT}
    assert not too_long, f"split these modules (over {MAX_LINES} lines): {too_long}"


def test_the_rule_sees_a_long_module(tmp_path):
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "small.py").write_text("x = 1\n")
    assert module_lengths(tmp_path) == {"big.py": MAX_LINES + 1, "small.py": 1}
