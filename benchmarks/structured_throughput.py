"""Offline throughput with a JSON schema on every request, against the same workload plain:
256 prompts x 128 random token ids in, 128 out, greedy, ignore_eos, bundled model (fp32
weights from its GGUF), as `minivllm bench throughput` builds it. `--quantization none` is
this script's default, because LLM() now keeps a GGUF's blocks for the int8 kernels
(`--quantization gguf` measures those). Each run is a fresh process; the two modes
alternate. Prints output tokens/s of both, their ratio, and the compile time of each
schema (the engine's own compile path, timed apart from the runs).

    .venv/bin/python benchmarks/structured_throughput.py --runs 3

Why this schema. With ignore_eos, a request runs to max_tokens whatever the grammar says;
once the grammar is complete, xgrammar (and so vLLM) allows only the stop tokens, so the
rest of the output is EOS after EOS, every step. A schema whose outputs end after 20
tokens would then time 20 constrained tokens and 108 tokens of an almost free mask: the
ratio would flatter the grammar. So the schema here cannot be completed within the
output: an array of at least `min_items` records (five typed fields each: integer with
bounds, string with a length range, enum, bounded number, boolean), where one record is
at least ~20 tokens. Every one of the 128 tokens of every request is then sampled under a
live grammar (the bitmask filled during the forward pass, applied, the matcher advanced),
which is what a long structured answer costs. The script checks it after the timed run:
every token is one the grammar accepts, and no output completes its grammar.

`--num-schemas 1` (default) sends the same schema with every request, as an API client
does: it compiles once, inside the timed run (the engine compiles it while the other
requests wait, as a server would). The engine's one-time structured-output setup (its
tokenizer and xgrammar's vocabulary tables, seconds, paid once by a server) is warmed up
before the run, with a regex. `--num-schemas N` cycles the requests over N distinct
schemas (the same shape, renamed keys): N compiles inside the run. The first compile of
an engine includes xgrammar's one-time setup (190 ms against 3 ms for the next schema in a
smoke run), and schemas of one shape share xgrammar's caches: the figure for a second,
unrelated schema would lie between the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "active"],
    "additionalProperties": False,
}


def schema(index: int, min_items: int) -> dict:
    """The index-th distinct schema: records under a key named after the index."""
    return {
        "type": "object",
        "properties": {
            f"records_{index}": {"type": "array", "items": RECORD, "minItems": min_items}
        },
        "required": [f"records_{index}"],
        "additionalProperties": False,
    }


def min_items_for(output_len: int) -> int:
    # A record is at least ~20 tokens; two spare ones keep the grammar alive to the end.
    return output_len // 20 + 2


def check_outputs(llm, outputs, params) -> None:
    """Each schema output follows its grammar token by token and never completes it."""
    from minivllm.structured_output.backend_xgrammar import XgrammarBackend
    from minivllm.structured_output.grammar import grammar_spec

    backend = XgrammarBackend(llm.get_tokenizer(), llm.llm_engine.model_config.vocab_size)
    for output, p in zip(outputs, params):
        matcher = backend.matcher(backend.compile(grammar_spec(p.structured_outputs)))
        for token in output.outputs[0].token_ids:
            assert matcher.accept_token(token), output.outputs[0].text
        assert not matcher.is_terminated(), "the grammar ended inside the output"


def run_in_this_process(mode: str, args: argparse.Namespace) -> dict:
    from minivllm import LLM, SamplingParams, StructuredOutputsParams
    from minivllm.bench.datasets import random_token_prompts

    llm = LLM(quantization=args.quantization)
    tokenizer = llm.get_tokenizer()
    prompts = random_token_prompts(tokenizer, args.num_prompts, args.input_len, seed=0)
    plain = dict(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    if mode == "plain":
        params = [SamplingParams(**plain)] * len(prompts)
    else:
        schemas = [schema(i, min_items_for(args.output_len)) for i in range(args.num_schemas)]
        params = [
            SamplingParams(
                **plain,
                structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]),
            )
            for i in range(len(prompts))
        ]
    # Warm-up outside the figure. Schema mode: also the engine's one-time structured-output
    # setup (tokenizer, xgrammar's vocabulary tables), with a regex, not the run's schema.
    warm = SamplingParams(max_tokens=2)
    if mode == "schema":
        warm = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="ab"))
    llm.generate({"prompt_token_ids": prompts[0][:16]}, warm, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert output_tokens == args.num_prompts * args.output_len
    if mode == "schema":
        check_outputs(llm, outputs, params)
    llm.llm_engine.shutdown()
    return {"elapsed_time": elapsed, "output_tokens_per_second": output_tokens / elapsed}


def compile_times(args: argparse.Namespace) -> list[float]:
    """Seconds to compile each schema, through the engine's StructuredOutputManager."""
    from minivllm import EngineArgs, StructuredOutputsParams
    from minivllm.engine.create_config import create_vllm_config
    from minivllm.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(create_vllm_config(EngineArgs()).model_config)
    manager.backend  # noqa: B018 (tokenizer and vocabulary: once per engine, not per schema)
    requests = [
        manager.new_request(StructuredOutputsParams(json=schema(i, min_items_for(args.output_len))))
        for i in range(args.num_schemas)
    ]
    for request in requests:
        request.compiled.result()
    manager.shutdown()
    return list(manager.compile_seconds.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-schemas", type=int, default=1, help="distinct schemas")
    parser.add_argument(
        "--quantization", default="none", choices=["gguf", "none"], help="GGUF: keep blocks or not"
    )
    parser.add_argument("--child", choices=["plain", "schema"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_in_this_process(args.child, args)))
        return
    seconds = compile_times(args)
    print(
        f"compile time per schema ({len(seconds)}): "
        + ", ".join(f"{s * 1000:.1f} ms" for s in seconds),
        flush=True,
    )
    results: dict[str, list[float]] = {"plain": [], "schema": []}
    for i in range(args.runs):
        for mode in results:
            command = [sys.executable, __file__, "--child", mode]
            for flag in ("num_prompts", "input_len", "output_len", "num_schemas", "quantization"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[mode].append(result["output_tokens_per_second"])
            print(
                f"run {i + 1} {mode:>6}: {result['elapsed_time']:6.1f} s  "
                f"{result['output_tokens_per_second']:6.1f} output tok/s",
                flush=True,
            )
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    for mode, value in medians.items():
        print(f"median {mode:>6}: {value:.1f} output tok/s")
    print(f"schema / plain: {medians['schema'] / medians['plain']:.3f}")
    later = (
        f", later ones median {statistics.median(seconds[1:]) * 1000:.1f} ms" if seconds[1:] else ""
    )
    print(f"compile time: first schema {seconds[0] * 1000:.1f} ms (with one-time setup){later}")


if __name__ == "__main__":
    main()
