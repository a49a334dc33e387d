"""EngineArgs: the user's engine options (vLLM's names, defaults and module path).

Each field carries what its flag says (``help``) and accepts (``choices``, ``minimum``, a
``parse`` function) as dataclass metadata; ``EngineArgs.add_cli_args`` builds the flags of
`minivllm serve`, `minivllm bench` and the examples from it, and ``validate`` checks a
value against the same metadata. Adding an option is one field here (plus, when it
derives a config value, one rule in ``engine/create_config.py``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from minivllm import envs
from minivllm.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEVICES,
    KV_CACHE_DTYPES,
    PoolerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count: 1073741824, 1G, 1GiB, 1GB, 0.5g, 512M (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4G, 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** ("kmgt".index(unit) + 1 if unit else 0))


def multiprocessing_default() -> bool:
    """MINIVLLM_ENABLE_MULTIPROCESSING (like VLLM_ENABLE_V1_MULTIPROCESSING): 0 runs the
    engine core in the frontend's process; on (1) by default."""
    return envs.MINIVLLM_ENABLE_MULTIPROCESSING


def arg_field(
    default: Any,
    help: str,
    *,
    choices: Iterable[str] | None = None,
    minimum: float | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """An engine option: its default, its flag's help, and what it accepts (``choices``;
    ``minimum``, inclusive, for a number; ``parse``, the flag's text to a value, where the
    field's type does not say it)."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None}
    metadata |= {"minimum": minimum, "parse": parse}
    return field(default=default, metadata=metadata)


# vLLM's --dtype values minivllm takes ("auto": as the platform decides from the checkpoint).
DTYPES = ("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half")
# Online modes: a float checkpoint quantized at load to these GGUF block types (llama.cpp's
# names, lower case), run as a GGUF file of that type (model/layers/quantization/online.py).
ONLINE_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
QUANTIZATIONS = ("gguf", "mxfp4", "none", *ONLINE_QUANTIZATIONS)
# vLLM's --load-format values minivllm reads: "safetensors" and "gguf" name what "auto" finds
# by the path (and fail on the other kind); "dummy" reads no weights.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
EXECUTOR_BACKENDS = ("mp", "ray", "uni")
# What the model is run for (vLLM's --runner): "generate" samples tokens, "pooling" returns
# one embedding per prompt; "auto" picks from the architecture's name (or a GGUF header).
RUNNERS = ("auto", "generate", "pooling")
# How a generative architecture is turned into a pooling model (vLLM's --convert).
CONVERTS = ("auto", "none", "embed")
# vLLM's older --task, mapped to a runner.
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}


@dataclass
class EngineArgs:
    """Arguments for the engine, with vLLM's names and defaults."""

    model: str | None = arg_field(
        None,
        "A model directory, a .gguf file, a Hugging Face Hub id (org/name, downloaded once), "
        "one quantization of a Hub GGUF repo (org/name-GGUF:Q4_K_M), or ollama:NAME[:TAG] / "
        "lmstudio:PUBLISHER/REPO[:QUANT]. Default: the bundled SmolLM2-135M-Instruct GGUF "
        "(`minivllm serve`: the MODEL argument takes precedence).",
    )
    tokenizer: str | None = arg_field(
        None, "A tokenizer other than the model's: a model directory, .gguf file or Hub id."
    )
    tokenizer_mode: str = arg_field(
        "auto",
        "vLLM's tokenizer mode: the model's fast (Rust) tokenizer, as vLLM's auto and hf "
        "modes load it; vLLM's slow, mistral and custom modes are not served.",
        choices=("auto", "hf"),
    )
    revision: str | None = arg_field(
        None, "The Hub revision (branch, tag or commit) of a Hub model. Default: main."
    )
    tokenizer_revision: str | None = arg_field(
        None, "The Hub revision of a Hub tokenizer. Default: main."
    )
    download_dir: str | None = arg_field(
        None, "Where Hub models are downloaded and looked up. Default: the HF cache."
    )
    hf_file: str | None = arg_field(
        None, "The one file of a Hub GGUF repo to serve, as llama.cpp's --hf-file."
    )
    dtype: str = arg_field(
        "auto",
        "Weights and activations dtype. auto: on a GPU bfloat16 (float16 for a float16 "
        "checkpoint or a GPU without bf16); on a CPU the checkpoint's bfloat16 where the CPU "
        "has native bf16, else float32.",
        choices=DTYPES,
    )
    quantization: str | None = arg_field(
        None,
        "Weight format. Default: keep a .gguf file's (or an MXFP4 checkpoint's) blocks where "
        "the platform runs them (the CPU in float32), as vLLM infers it; gguf, mxfp4: ask for "
        "that; none: dequantize at load; q8_0, q4_0, q4_1, q5_0, q5_1: quantize a float "
        "checkpoint at load to those GGUF blocks (CPU, float32), served as a GGUF of that type.",
        choices=QUANTIZATIONS,
    )
    load_format: str = arg_field(
        "auto",
        "auto: the model's files (safetensors or GGUF); safetensors, gguf: that kind only; "
        "dummy: random weights in the model's shapes, only its config read (for measuring "
        "shapes whose weights are not at hand; the outputs mean nothing).",
        choices=LOAD_FORMATS,
    )
    seed: int = arg_field(0, "Seed of the random sampling of requests that set none.")
    max_model_len: int | None = arg_field(
        None,
        "Context length (prompt + output) per request. Default: the model's "
        "max_position_embeddings (with RoPE scaling).",
        minimum=1,
    )
    max_num_seqs: int = arg_field(256, "Most requests running at once (one batch).", minimum=1)
    max_num_batched_tokens: int | None = arg_field(
        None,
        "Token budget of one engine step (chunked prefill cuts longer prompts). Default: "
        f"max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, max-num-seqs).",
        minimum=1,
    )
    block_size: int = arg_field(16, "Tokens per KV cache block.", minimum=1)
    kv_cache_memory_bytes: int | None = arg_field(
        None,
        "KV cache size in bytes; accepts suffixes, e.g. 512M, 4G, 4GiB (powers of 1024). "
        "Default on CPU: MINIVLLM_CPU_KVCACHE_SPACE GiB (4 if unset); on a GPU: what "
        "--gpu-memory-utilization leaves.",
        minimum=1,
        parse=parse_size,
    )
    kv_cache_dtype: str = arg_field(
        "auto",
        "What the KV cache holds. auto: the model's dtype; int8 (= fp16k_int8v): keys in "
        "float16, values in int8 with one float32 scale per token and KV head (the 8-bit "
        "mode that keeps quality best); fp8 (= fp8_e4m3 = fp16k_e4m3v), fp8_e5m2 (= "
        "fp16k_e5m2v): keys in float16, values in float8 scaled per token and KV head; "
        "int8k_int8v: keys in int8 too, each channel divided by a power of two calibrated "
        "at start-up (outlier channels brought down), more tokens; e4m3k_e4m3v, "
        "e5m2k_e5m2v: keys and values in float8 with scale 1 (vLLM's CPU cache), lower "
        "quality. The same --kv-cache-memory-bytes "
        "holds 2.6x (int8, fp8), 3.8x (int8k_int8v) or 4x (e4m3k_e4m3v) the tokens of a "
        "float32 cache at head_dim 64.",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_disk: str | None = arg_field(
        None,
        "A folder for a persistent prefix cache: full blocks of prompts are written there "
        "(asynchronously) and read back on a later prefix-cache miss, across restarts and by "
        "every process of the same model on the machine. Needs prefix caching (sha256).",
    )
    kv_cache_disk_size: float = arg_field(
        10.0,
        "GiB the --kv-cache-disk folder may hold; least recently used blocks are removed.",
        minimum=0.001,
    )
    enable_prefix_caching: bool = arg_field(True, "Reuse the KV cache of shared prompt prefixes.")
    prefix_caching_hash_algo: str = arg_field(
        "sha256", "Hash of the prefix cache's blocks.", choices=("sha256", "builtin")
    )
    scheduling_policy: str = arg_field(
        "fcfs",
        "fcfs: first come, first served; priority: by each request's `priority` "
        "(lower first), then arrival; slo: each step composed from a step-time model "
        "fitted online, so that latency-sensitive requests meet their TPOT/TTFT targets "
        "and best-effort ones take the rest (minivllm's; see README).",
        choices=("fcfs", "priority", "slo"),
    )
    default_slo_tpot: float | None = arg_field(
        None,
        "TPOT target, seconds per output token, of a latency-sensitive request that sets no "
        "`slo` (--scheduling-policy slo). Default: none (such a request is only served first).",
        minimum=1e-3,
    )
    default_slo_ttft: float | None = arg_field(
        None,
        "TTFT target, seconds to the first token, of a latency-sensitive request that sets "
        "no `slo_ttft` (--scheduling-policy slo).",
        minimum=1e-3,
    )
    device: str = arg_field(
        "auto",
        "Device to run the model on. auto: CUDA when torch sees a GPU, else the CPU.",
        choices=DEVICES,
    )
    enforce_eager: bool = arg_field(
        False,
        "Run every step eagerly: no graphs (CUDA graphs on a GPU; on the CPU, decode steps "
        "are not replayed as kernel calls).",
    )
    # None reads as on (vLLM V1's default); the flag's absence must stay distinguishable
    # from --enable-chunked-prefill for the token-budget rule.
    enable_chunked_prefill: bool | None = arg_field(
        None,
        "Split long prompts over several steps (on by default, as in vLLM V1). Off: each "
        "prompt is prefilled whole, and max-num-batched-tokens is raised to max-model-len.",
    )
    # None: on for CUDA where it combines (vLLM's default), off elsewhere.
    async_scheduling: bool | None = arg_field(
        None,
        "Schedule and launch step N+1 before step N's sampled tokens are read (they reach "
        "its inputs on the device), so the host's work overlaps the device's. Greedy outputs "
        "are unchanged; a request that stops has computed one token more; steps go one at a "
        "time while a request samples from its own outputs on the host (penalties, "
        "min_tokens, bad words, a grammar). One worker only (tensor-parallel-size 1, uni), "
        "no speculative decoding. Default: on for a CUDA device where those hold, off "
        "elsewhere.",
    )
    gpu_memory_utilization: float = arg_field(
        0.9,
        "Share of the GPU's memory the engine may use: the KV cache gets what is left after "
        "the weights and a profiling pass's peak (--kv-cache-memory-bytes overrides it). "
        "Accepted and unused on a CPU.",
    )
    kv_sharing_fast_prefill: bool = arg_field(
        False,
        "Layers that read earlier layers' KV cache (Gemma 4's last ones) compute only the "
        "prompt rows that give logits: faster prompts, the same outputs (a step with prompt "
        "logprobs computes every row).",
    )
    trust_remote_code: bool = arg_field(
        False,
        "Accepted for vLLM compatibility: minivllm's model classes are its own, so no code "
        "from a checkpoint is ever run.",
    )
    swap_space: float = arg_field(
        4,
        "Accepted for vLLM compatibility (GiB of CPU swap space in vLLM's V0): preempted "
        "requests are recomputed, never swapped.",
        minimum=0,
    )
    tensor_parallel_size: int = arg_field(
        1,
        "Split the model over this many worker processes (tensor parallelism); the "
        "model's attention heads must divide by it.",
        minimum=1,
    )
    distributed_executor_backend: str | None = arg_field(
        None,
        "How the tensor-parallel workers run: mp (processes on this machine, the default "
        "when tensor-parallel-size > 1), ray (Ray actors; joins RAY_ADDRESS's cluster or "
        "starts a local one), uni (one worker, in the engine process).",
        choices=EXECUTOR_BACKENDS,
    )
    pipeline_parallel_size: int = arg_field(
        1,
        "Split the model's layers into this many stages (pipeline parallelism), each a "
        "worker process (or Ray actor) holding only its layers' weights and KV cache; the "
        "engine keeps a batch in flight per stage. Combines with tensor-parallel-size "
        "(each stage then has that many ranks). Stages are as even as whole layers allow; "
        "VLLM_PP_LAYER_PARTITION sets them.",
        minimum=1,
    )
    data_parallel_size: int = arg_field(
        1,
        "Serve with this many engine cores (data parallelism), each its own process with "
        "its own scheduler and KV cache, behind one frontend that sends each request to "
        "the core holding the longest cached prefix of its prompt, else the least loaded. "
        "On one machine the cores share its CPU threads; with distributed-executor-backend "
        "ray each core is a Ray actor, spread over the cluster's nodes.",
        minimum=1,
    )
    enable_multiprocessing: bool | None = arg_field(
        None,
        "Run the engine core in its own process (vLLM's default; the server's always is). "
        "Default: MINIVLLM_ENABLE_MULTIPROCESSING.",
    )
    generation_config: str = arg_field(
        "auto",
        "Default sampling parameters: auto, those the model directory's "
        "generation_config.json recommends; vllm, vLLM's own; or a folder whose "
        "generation_config.json gives them.",
    )
    override_generation_config: dict | str | None = arg_field(
        None,
        "Default sampling parameters that override generation-config's, as JSON with "
        'generation_config.json\'s names: \'{"temperature": 0.5, "max_new_tokens": 256}\'.',
    )
    runner: str = arg_field(
        "auto",
        "What the model is run for. generate: completions and chat; pooling: embeddings "
        "(/v1/embeddings); auto: pooling for an embedding model's checkpoint (a bare "
        "`...Model` architecture, a GGUF file with a pooling type), else generate.",
        choices=RUNNERS,
    )
    convert: str = arg_field(
        "auto",
        "How a generative architecture is adapted (vLLM's --convert; classify and reward "
        "are not served). embed: pooled for embeddings (as --runner pooling); auto, none: "
        "as --runner says.",
        choices=CONVERTS,
    )
    pooler_config: PoolerConfig | dict | str | None = arg_field(
        None,
        "How a pooling model makes one embedding of a prompt's hidden states, as JSON: "
        '\'{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true|false}\'. Default: what '
        "the checkpoint declares, else LAST, normalized.",
    )
    task: str = arg_field(
        "auto",
        "vLLM's older name for the runner: embed (or embedding) is --runner pooling, "
        "generate is --runner generate.",
        choices=TASKS,
    )
    enable_lora: bool = arg_field(
        False,
        "Serve LoRA adapters per request (LLM.generate(..., lora_request=...), the server's "
        "--lora-modules).",
    )
    max_loras: int = arg_field(1, "Most LoRA adapters in one step.", minimum=1)
    max_lora_rank: int = arg_field(16, "Largest rank of a LoRA adapter.", minimum=1)
    max_cpu_loras: int | None = arg_field(
        None, "Most LoRA adapters kept read on the host. Default: max-loras."
    )
    speculative_config: SpeculativeConfig | dict | str | None = arg_field(
        None,
        "Speculative decoding, as JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'. '
        "Requests with penalties, min_tokens, bad words, a grammar or logprobs decode a "
        "token a step.",
    )
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = arg_field(
        None,
        "How grammars are built from JSON schemas, as JSON: "
        "'{\"json_max_string_length\": 256}': a JSON string with no maxLength holds at most "
        "that many characters and at most a quarter of the request's max_tokens (default "
        "256; 0: unbounded), so a sampled reply cannot write one string until max_tokens. "
        "A schema's own maxLength is kept as written.",
    )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, only: Iterable[str] | None = None
    ) -> argparse.ArgumentParser:
        """Add one ``--field-name`` flag per engine argument (those named in ``only``, if
        given), with its help and choices; ``parser`` may be an argument group."""
        wanted = None if only is None else set(only)
        for f in fields(cls):
            if wanted is None or f.name in wanted:
                _add_flag(parser, f)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The engine arguments among the parsed flags (the others are left out)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def use_multiprocessing(self) -> bool:
        if self.enable_multiprocessing is None:
            return multiprocessing_default()
        return self.enable_multiprocessing

    def validate(self) -> None:
        """Raise ValueError on a value its field's metadata does not accept, or on options
        that do not combine (``create_config.check_engine_args``)."""
        for f in fields(self):
            value = getattr(self, f.name)
            choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
            if value is None:
                continue
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}.")
            if minimum is not None and value < minimum:
                bound = "positive" if minimum > 0 else "negative"
                verb = "must be" if minimum > 0 else "must not be"
                raise ValueError(f"{f.name} {verb} {bound}, got {value}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        PoolerConfig.parse(self.pooler_config)  # a bad one fails here


# vLLM's short spellings of its parallelism flags (`vllm serve MODEL -tp 2`).
_SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
}


def _add_flag(parser: argparse.ArgumentParser, f: Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    flags = [flag, _SHORT_FLAGS[f.name]] if f.name in _SHORT_FLAGS else [flag]
    default = f.default if f.default is not MISSING else None
    help_text = f.metadata.get("help")
    kind = str(f.type)
    if kind.startswith("bool"):
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
        )
        return
    cast = f.metadata.get("parse")
    if cast is None:
        cast = int if kind.startswith("int") else float if kind.startswith("float") else str
    choices = f.metadata.get("choices")
    parser.add_argument(
        *flags,
        type=cast,
        default=default,
        choices=list(choices) if choices else None,
        help=help_text,
    )


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name); the engine core always runs in its own process."""

    enable_log_requests: bool = arg_field(False, "Log every request as it is added and aborted.")
