"""Python calls made by one steady decode step of the model runner: the host-side cost a
refactor of the step may not raise (one stream's decode on a CPU is host-bound).

    PYTHONPATH=TREE .venv/bin/python benchmarks/step_calls.py [STREAMS] [--async]

prints, for the last decode steps of a greedy run on the bundled model, (requests in the
step, Python function calls, C function calls) inside ``ModelRunner.execute_model``
(an async step's output collected too). Run it for two trees (a commit and the one before
it): the counts are deterministic, so any difference is the change's.
"""

import sys

from minivllm import LLM, SamplingParams
from minivllm.model.loader import default_model_path


def main() -> None:
    streams = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
    llm = LLM(
        default_model_path(),
        max_model_len=256,
        enable_multiprocessing=False,
        kv_cache_memory_bytes=1 << 27,
        async_scheduling="--async" in sys.argv,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    counts = []
    execute = runner.execute_model

    def counted(so):
        calls = {"call": 0, "c_call": 0}

        def profile(frame, event, arg):
            if event in calls:
                calls[event] += 1

        sys.setprofile(profile)
        try:
            out = execute(so)
            if hasattr(out, "get_output"):
                out.get_output()
        finally:
            sys.setprofile(None)
        counts.append((len(so.num_scheduled_tokens), calls["call"], calls["c_call"]))
        return out

    runner.execute_model = counted
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(["Hello, my name is"] * streams, params, use_tqdm=False)
    print(counts[-6:])


if __name__ == "__main__":
    main()
