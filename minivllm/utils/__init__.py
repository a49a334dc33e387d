"""Helpers shared across packages: processes, ZeroMQ sockets, remote errors, argparse."""

from minivllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
