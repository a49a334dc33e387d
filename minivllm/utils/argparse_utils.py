"""vLLM's argument parsing habits: underscores in flag names, and `--config FILE.yaml`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reads `--max_model_len 8` as `--max-model-len 8`, as vLLM's does.

    Only the flag's name is rewritten (before any `=value`), so values keep their underscores.
    `--config FILE` reads flags from a YAML file (vLLM's serve config: `port: 8000`,
    `tensor-parallel-size: 2`, `enforce-eager: true`); the command line's own come after
    them, so that they win.
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        args = [_dashed(arg) for arg in args]
        if self._subparsers is None:  # (a command's own parser reads its --config)
            args = _with_config_file(args, self._option_string_actions)
        return super().parse_known_args(args, namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _with_config_file(args: list[str], known: dict) -> list[str]:
    """args with `--config FILE` replaced by the file's flags, placed first."""
    for i, arg in enumerate(args):
        name, sep, path = arg.partition("=")
        if name != "--config":
            continue
        if not sep:  # the path is the next argument
            if i + 1 >= len(args):
                raise SystemExit("--config needs a YAML file's path.")
            path = args[i + 1]
        return config_file_args(path, known) + args[:i] + args[i + (1 if sep else 2) :]
    return args


def config_file_args(path: str, known: dict) -> list[str]:
    """A YAML file's mapping as flags: `key: value` is `--key value`; true is `--key`,
    false `--no-key` (where the parser has it; else the flag is left out: off); a list
    gives its items; a mapping is passed as JSON. known: the parser's option strings."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"--config {path}: {exc}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise SystemExit(f"--config {path}: the file must hold a mapping of flags to values.")
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in known:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
