"""`minivllm bench startup`: seconds from a fresh process to the first token of LLM()."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from minivllm.bench.common import write_json

_CHILD = """
import time
t0 = float({t0!r})
from minivllm import LLM, SamplingParams
llm = LLM({model!r})
out = llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
print("FIRST_TOKEN_AT", time.time() - t0)
"""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    times = []
    for _ in range(args.num_iters):
        t0 = time.time()
        code = _CHILD.format(t0=t0, model=args.model)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        seconds = float(out.split("FIRST_TOKEN_AT")[-1].split()[0])  # the number alone
        times.append(seconds)
        print(f"Start-up to first token: {seconds:.2f} s")
    results = {"startup_seconds": times}
    write_json(args.output_json, results)
    return results
