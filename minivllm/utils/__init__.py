"""Small helpers under vLLM's `vllm.utils` names."""

from minivllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
