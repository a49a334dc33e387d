"""The `minivllm` command: `minivllm serve [MODEL]`, `minivllm chat` and `minivllm complete`
(terminal clients of a running server), and `minivllm bench ...` when the benchmarks
package is installed.

Each subcommand registers itself on the subparsers and sets `dispatch`, the function that
runs it with the parsed arguments. Heavy imports (torch, the server) happen in dispatch,
so that `--help` is quick.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from minivllm.entrypoints import cli_chat
from minivllm.utils import FlexibleArgumentParser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is empty or its help already says it."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "Default:" in text or "default" in text:
            return text
        return super()._get_help_string(action)


def _run_serve(args: argparse.Namespace) -> None:
    from minivllm.engine.core_client import start_engine_core
    from minivllm.entrypoints.openai.cli_args import engine_args_from
    from minivllm.entrypoints.openai.model_router_args import is_many_models

    if is_many_models(args):  # no engine until a request names its model
        from minivllm.entrypoints.openai.api_server import exit_server_process, run_server

        run_server(args)
        exit_server_process()
    # The engine core's process starts before the server's imports (torch, transformers,
    # fastapi): the two processes import side by side, seconds of start-up.
    engine_core = start_engine_core(engine_args_from(args), asyncio_mode=True)
    try:
        from minivllm.entrypoints.openai.api_server import exit_server_process, run_server
    except BaseException:
        engine_core.shutdown()
        raise
    run_server(args, engine_core)
    exit_server_process()


def register_serve(subparsers) -> None:
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (vLLM's `vllm serve`) on MODEL.",
        formatter_class=_HelpFormatter,
    )
    make_arg_parser(parser)
    parser.set_defaults(dispatch=_run_serve)


def make_parser() -> argparse.ArgumentParser:
    # Flexible, as vLLM's: its commands' parsers (of the same class) read `--max_model_len`
    # as `--max-model-len`, and `--config FILE.yaml`.
    parser = FlexibleArgumentParser(
        prog="minivllm", description="A small LLM inference and serving engine."
    )
    parser.add_argument("-v", "--version", action="store_true", help="Print the version.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    register_serve(subparsers)
    cli_chat.register(subparsers)
    if importlib.util.find_spec("minivllm.bench") is not None:
        from minivllm import bench

        bench.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.version:
        import minivllm

        print(minivllm.__version__)
        return
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    from minivllm.model.sources.errors import ModelSourceError

    try:
        args.dispatch(args)
    except ModelSourceError as e:  # a model that cannot be had: one line, no traceback
        print(f"minivllm: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
