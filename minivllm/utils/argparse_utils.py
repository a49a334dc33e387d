"""FlexibleArgumentParser: vLLM's argparse parser, which also takes `--flag_name` spellings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reads `--max_model_len 8` as `--max-model-len 8`, as vLLM's does.

    Only the flag's name is rewritten (before any `=value`), so values keep their underscores.
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
