"""benchmarks/serve_trace.py: its breakdown from hand-made trace records, and its patches
finding the engine methods they wrap (a rename would otherwise leave a trace silently empty).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import serve_trace  # noqa: E402


def write(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def step(t0, t, new=(), first=(), tok=1, reqs=1):
    return dict(
        ev="step", t0=t0, ts=t0 + 0.001, tx=t - 0.001, t=t, tok=tok, reqs=reqs,
        new=list(new), first=list(first),
    )  # fmt: skip


def test_summarize_splits_ttft_into_its_parts(tmp_path):
    prefix = str(tmp_path / "trace")
    # Request a: sent at 1.0 during a step [0.9, 1.2]; scheduled in the next one [1.2, 1.5].
    # Request b: sent at 1.3; its step [1.5, 1.9] (it waited for a's step to end).
    write(
        prefix + ".100",
        [
            dict(ev="sent", id="a", http=0.99, t0=0.995, t=1.0),
            dict(ev="sent", id="b", http=1.29, t0=1.295, t=1.3),
            dict(ev="first", id="a", t=1.51),
            dict(ev="first", id="b", t=1.92),
        ],
    )
    write(
        prefix + ".200",
        [
            dict(ev="recv", id="a", t=1.001),
            dict(ev="add", id="a", t=1.2),
            dict(ev="recv", id="b", t=1.301),
            dict(ev="add", id="b", t=1.5),
            step(0.9, 1.2, reqs=3),
            step(1.2, 1.5, new=["a"], first=["a"], tok=131, reqs=4),
            step(1.5, 1.9, new=["b"], first=["b"], tok=132, reqs=5),
        ],
    )
    text = serve_trace.summarize(prefix, {"median_ttft_ms": 600.0, "mean_ttft_ms": 610.0})
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert rows["waiting for the step in progress to end"] == "199.0"  # a 199, b 199
    assert rows["its first step(s), start to end"] == "350.0"  # a 300, b 400
    assert rows["step end -> frontend output processor"] == "15.0"  # a 10, b 20
    assert rows["sum (handler start -> first token in the frontend)"] == "575.0"  # 520, 630
    assert rows["client TTFT (bench serve)"] == "600.0"
    assert "2 requests traced" in text
    assert "| with a new prompt | 2 | 350.0 |" in text
    assert "| decode only | 1 | 300.0 |" in text


def test_install_wraps_the_engine_methods(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import serve_trace\n"
        "from minivllm.engine import async_llm, core, core_proc, output_processor\n"
        "from minivllm.entrypoints.openai import serving_completion as sc\n"
        "def targets():\n"
        "    return [\n"
        "        sc.OpenAIServingCompletion.create_completion,\n"
        "        async_llm.AsyncLLM.add_request,\n"
        "        output_processor.OutputProcessor.process_outputs,\n"
        "        core.EngineCore.add_request,\n"
        "        core.EngineCore.step,\n"
        "        core_proc.EngineCoreProc.__init__,\n"
        "    ]\n"
        "before = targets()\n"
        "serve_trace.install()\n"
        "pairs = zip(targets(), before)\n"
        "assert all(a is not b and a.__module__ == 'serve_trace' for a, b in pairs)\n"
    )
    env = {**os.environ, "MINIVLLM_SERVE_TRACE": str(tmp_path / "trace")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
