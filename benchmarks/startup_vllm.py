"""vLLM's start-up to first token of `LLM()`, measured as `minivllm bench startup` measures ours.

Runs the peer (its own virtualenv, both cores bound, float32) on the prepared fp32 HF
directory, in a fresh process per run; nothing is installed into the project's venv.

    .venv/bin/python benchmarks/startup_vllm.py --num-iters 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from compare_vllm import PEER_ENV  # noqa: E402
from prepare_model import prepare  # noqa: E402

# vLLM's engine core starts with spawn: the body must sit under the main guard.
_CHILD = """
import time
t0 = float({t0!r})
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM({model!r}, dtype="float32", enable_prefix_caching=False)
    llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
    print("FIRST_TOKEN_AT", time.time() - t0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-iters", type=int, default=1)
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    args = parser.parse_args()
    model = prepare()
    for _ in range(args.num_iters):
        t0 = time.time()
        out = subprocess.run(
            [os.path.join(args.peer, "bin", "python"), "-c", _CHILD.format(t0=t0, model=model)],
            env={**os.environ, **PEER_ENV},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # vLLM logs its shutdown to stdout after our line: take the number alone.
        seconds = float(out.split("FIRST_TOKEN_AT")[-1].split()[0])
        print(f"vLLM start-up to first token: {seconds:.1f} s")


if __name__ == "__main__":
    main()
