"""EngineArgs, the user's knobs, and the small configs derived from them."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from minivllm import envs

if TYPE_CHECKING:
    from minivllm.model.layers.quantization.base import QuantizationConfig
    from minivllm.platforms.interface import Platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_memory_bytes: int | None = None  # None: measured (gpu_memory_utilization)
    gpu_memory_utilization: float = 0.9
    # Layers that read earlier layers' K/V (Gemma 4's last ones) compute a prompt's rows
    # that give logits only (vLLM's flag, off by default as there).
    kv_sharing_fast_prefill: bool = False


# Tokens per step when not set. On the CPU smaller steps were faster on the standard
# throughput workload (8192: 118.7 s, 4096: 113.8, 2048: 109.1, 1024: 107.7; the large
# activations of a long chunk leave the caches), and they let running decodes share each
# step with a prompt chunk sooner.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 8192
    policy: str = "fcfs"
    # Off: a prompt is scheduled whole in one step or waits (vLLM's --no-enable-chunked-prefill).
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs (see EngineArgs).
    async_scheduling: bool = False


EXECUTOR_BACKENDS = ("uni", "mp", "ray")

# What the model is run for (vLLM's --runner): "generate" samples tokens, "pooling" returns
# one embedding per prompt; "auto" picks from the architecture's name (or a GGUF header).
RUNNERS = ("auto", "generate", "pooling")
# vLLM's --load-format values minivllm reads: "safetensors" and "gguf" name what "auto" finds
# by the path (and fail on the other kind); "dummy" reads no weights.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# How a generative architecture is turned into a pooling model (vLLM's --convert).
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# A classifier checkpoint's architecture ends so: the network and a `score` head of
# num_labels outputs over the last token's hidden state, run by the pooling runner.
SEQUENCE_CLASSIFIER = "ForSequenceClassification"


def is_sequence_classifier(hf_config) -> bool:
    architectures = getattr(hf_config, "architectures", None) or [""]
    return architectures[0].endswith(SEQUENCE_CLASSIFIER)


# vLLM's older --task, mapped to a runner.
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}


def json_object(name: str, value: dict | str, known: set[str]) -> dict:
    """A config given as a dict or its JSON text (the command line's form), with only
    known fields; a ValueError names what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}.")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"Unknown {name} field(s): {', '.join(unknown)}")
    return value


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's final hidden states into one embedding (vLLM's
    --pooler-config): the last token's (LAST), their mean (MEAN) or the first token's
    (CLS); L2-normalized unless normalize is False. None: what the checkpoint declares
    (sentence-transformers' files, a GGUF header), else LAST, normalized."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}."
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}.")

    @classmethod
    def parse(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
        """From a PoolerConfig, a dict, or its JSON text (the command line's form)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        value = json_object("pooler_config", value, {"pooling_type", "normalize"})
        pooling_type = value.get("pooling_type")
        return cls(
            pooling_type=pooling_type.upper() if isinstance(pooling_type, str) else pooling_type,
            normalize=value.get("normalize"),
        )


# Speculative decoding methods served: "ngram" proposes the tokens that followed an earlier
# occurrence of the output's last n-gram (prompt lookup); draft models are not served.
SPECULATIVE_METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): each step of a request also
    computes up to num_speculative_tokens proposed tokens, and keeps those that its own
    sampled token at each row agrees with, plus the token sampled after the last kept one.
    For "ngram", the proposal is what followed the latest earlier occurrence of the
    sequence's last n tokens, the longest n in [prompt_lookup_min, prompt_lookup_max] that
    occurs."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)} "
                f"(draft models are not served), got {self.method!r}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}."
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be at "
                f"most prompt_lookup_max ({self.prompt_lookup_max})."
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or its JSON text (the command line's form); a
        missing lookup bound takes the other's value, both missing take 5 (vLLM's rule)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        value = json_object("speculative_config", value, known)
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens.")
        high, low = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        high = high if high is not None else low if low is not None else DEFAULT_PROMPT_LOOKUP
        low = low if low is not None else high
        return cls(
            num_speculative_tokens=value["num_speculative_tokens"],
            method=value.get("method") or "ngram",
            prompt_lookup_max=high,
            prompt_lookup_min=low,
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor_parallel_size ranks, run by which executor."""

    tensor_parallel_size: int = 1
    # "uni": one worker in the engine core's process; "mp": one process per rank on this
    # machine; "ray": one Ray actor per rank, on a Ray cluster.
    distributed_executor_backend: str = "uni"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def verify_with_model(self, hf_config) -> None:
        """Raise ValueError when the model cannot be split into tensor_parallel_size ranks."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        heads = hf_config.num_attention_heads
        checks = [(heads % tp == 0, f"its {heads} attention heads (num_attention_heads)")]
        checks += [
            (
                kv_heads % tp == 0 or tp % kv_heads == 0,
                f"its {kv_heads} key/value heads (num_key_value_heads), nor is a multiple of them",
            )
            for kv_heads in _kv_head_counts(hf_config)
        ]
        checks += [
            (
                hf_config.intermediate_size % tp == 0,
                f"its MLP width of {hf_config.intermediate_size} (intermediate_size)",
            ),
        ]
        # Mixtures of experts split each expert (and Qwen2-MoE's shared one) the same way.
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            width = getattr(hf_config, name, None)
            if width:
                checks.append((width % tp == 0, f"its expert MLP width of {width} ({name})"))
        for ok, what in checks:
            if not ok:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide {what}: each rank must hold "
                    f"an equal share of whole heads and MLP columns, so this model cannot "
                    f"be split into {tp} ranks. Choose a tensor_parallel_size that does."
                )


def _kv_head_counts(hf_config) -> set[int]:
    """The KV head counts of a model's layers (Gemma 4's global layers have their own, in
    transformers' per-layer view of the config)."""
    if getattr(hf_config, "per_layer_config", None) is not None:
        layers = range(hf_config.num_hidden_layers)
        per_layer = hf_config.per_layer_config
        counts = {getattr(per_layer[i], "num_key_value_heads", None) for i in layers}
        if None not in counts:
            return counts
    return {getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}


def multiprocessing_default() -> bool:
    """MINIVLLM_ENABLE_MULTIPROCESSING (like VLLM_ENABLE_V1_MULTIPROCESSING): 0 runs the
    engine core in the frontend's process; on (1) by default."""
    return envs.MINIVLLM_ENABLE_MULTIPROCESSING


# The generation_config.json fields that become default sampling parameters, as in vLLM.
_GENERATION_CONFIG_SAMPLING = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


@dataclass
class EngineArgs:
    """Arguments for the engine, with vLLM's names and defaults."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    dtype: str = "auto"
    # None: "gguf" for a .gguf model or an MXFP4 checkpoint (vLLM infers it); "none":
    # dequantize at load
    quantization: str | None = None
    # "auto": the model's files (safetensors or GGUF); "dummy": random weights in the
    # model's shapes, only its config read (vLLM's flag, for measuring shapes whose weights
    # are not at hand; the outputs mean nothing).
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    scheduling_policy: str = "fcfs"
    device: str = "auto"  # CUDA when torch sees a GPU, else the CPU
    enforce_eager: bool = False  # no graphs: CUDA graphs on a GPU, replayed kernel calls on a CPU
    # None: on, as in vLLM's V1 engine. Off: each prompt is prefilled in one step, and the
    # step's token budget is raised to max_model_len so that any prompt fits.
    enable_chunked_prefill: bool | None = None
    # vLLM's --async-scheduling: the engine core schedules step N+1 and launches it before
    # it waits for step N's sampled tokens, which reach step N+1's inputs on the device; the
    # host's scheduling and output handling then overlap the device's work (on a GPU, a
    # small model's decode step is mostly that host time). Greedy outputs are unchanged; a
    # request that stops (EOS, a stop token) has computed one token more; one preempted with
    # a token in flight draws it again (seeded sampling can differ). Steps go one at a
    # time while a request samples from its own earlier outputs on the host (penalties,
    # min_tokens, bad words, a grammar). One worker only (tensor_parallel_size 1, "uni").
    async_scheduling: bool = False
    # Share of the GPU's memory the engine may use (weights, activations, KV cache): the KV
    # cache gets what a profiling pass leaves of it, unless kv_cache_memory_bytes is given.
    # On a CPU it is accepted and unused: the KV cache is sized by kv_cache_memory_bytes.
    gpu_memory_utilization: float = 0.9
    # Gemma 4's layers that read earlier layers' K/V skip the prompt rows no logits come
    # from (vLLM's flag and default): prompts 2-3x faster, outputs unchanged; a step with a
    # request that asks for prompt logprobs computes every row.
    kv_sharing_fast_prefill: bool = False
    # Accepted for vLLM compatibility: minivllm's model classes are its own, so no code from
    # a checkpoint is ever imported or run, whatever this says.
    trust_remote_code: bool = False
    # GiB of CPU swap space per GPU in vLLM's V0; accepted and unused: preempted requests
    # are recomputed, as in vLLM's V1.
    swap_space: float = 4
    tensor_parallel_size: int = 1
    # "mp" (one process per rank), "ray" (Ray actors) or "uni"; None: "uni" for one rank,
    # else "mp".
    distributed_executor_backend: str | None = None
    # The engine core in its own process (vLLM's default). None: from the environment.
    enable_multiprocessing: bool | None = None
    # Default sampling parameters (vLLM's --generation-config): "auto", those the model
    # directory's generation_config.json recommends; "vllm", vLLM's own; or a folder whose
    # generation_config.json gives them.
    generation_config: str = "auto"
    # "generate", "pooling" (embeddings: LLM.embed, /v1/embeddings) or "auto" (vLLM's
    # --runner): a "...Model" architecture, or a GGUF file that names a pooling type, pools.
    runner: str = "auto"
    # "embed" (or "auto"): a generative architecture pooled for embeddings (vLLM's --convert).
    convert: str = "auto"
    # PoolerConfig, a dict or its JSON text: {"pooling_type": "MEAN", "normalize": false}.
    pooler_config: PoolerConfig | dict | str | None = None
    # vLLM's older name for the runner: "embed" (or "embedding") pools, "generate" samples.
    task: str = "auto"
    # LoRA adapters per request (LLM.generate(..., lora_request=LoRARequest(...)), the
    # server's --lora-modules): at most max_loras of them in one step, each of rank at most
    # max_lora_rank; max_cpu_loras (default max_loras) stay read on the host.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's --speculative-config), a SpeculativeConfig, a dict or its
    # JSON text: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}.
    # Requests with penalties, min_tokens, bad words, a grammar or logprobs decode a token a
    # step.
    speculative_config: SpeculativeConfig | dict | str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one ``--field-name`` option per engine argument, as vLLM's EngineArgs does."""
        for f in fields(cls):
            if f.name == "extra":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            kind = str(f.type)
            if kind.startswith("bool"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            else:
                cast = int if kind.startswith("int") else float if kind.startswith("float") else str
                parser.add_argument(flag, type=cast, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def use_multiprocessing(self) -> bool:
        if self.enable_multiprocessing is None:
            return multiprocessing_default()
        return self.enable_multiprocessing

    def validate(self) -> None:
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
            os.path.expanduser(self.generation_config)
        ):
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder, got "
                f"{self.generation_config!r}."
            )
        if self.quantization not in (None, "gguf", "mxfp4", "none"):
            raise ValueError(
                f"quantization must be 'gguf', 'mxfp4' or 'none', got {self.quantization!r}."
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}."
            )
        if self.load_format == "dummy" and self.quantization not in (None, "none"):
            raise ValueError(
                f"load_format='dummy' makes plain weights; quantization={self.quantization!r} "
                "needs the checkpoint's own."
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}."
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."
            )
        if self.prefix_caching_hash_algo not in ("sha256", "builtin"):
            raise ValueError(
                "prefix_caching_hash_algo must be 'sha256' or 'builtin', "
                f"got {self.prefix_caching_hash_algo!r}."
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must not be negative, got {self.swap_space}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}."
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}."
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}.")
        if self.convert not in CONVERTS:
            raise ValueError(
                f"convert must be one of {', '.join(CONVERTS)} (classify and reward are not "
                f"served), got {self.convert!r}."
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        PoolerConfig.parse(self.pooler_config)  # a bad one fails here
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}."
            )
        if self.async_scheduling and (
            self.tensor_parallel_size > 1 or backend not in (None, "uni")
        ):
            raise ValueError(
                "async_scheduling runs one worker in the engine core's process: "
                "tensor_parallel_size=1 and distributed_executor_backend 'uni'."
            )
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})."
            )
        if SpeculativeConfig.parse(self.speculative_config) is not None and self.async_scheduling:
            raise ValueError(
                "speculative_config and async_scheduling do not combine: a step's proposals "
                "come from its accepted tokens, which async scheduling has not read yet."
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one worker; use 'mp' or 'ray' for "
                f"tensor_parallel_size={self.tensor_parallel_size}."
            )

    def create_cache_config(self, platform: Platform) -> CacheConfig:
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None:
            kv_bytes = platform.default_kv_cache_memory_bytes()
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_sharing_fast_prefill=self.kv_sharing_fast_prefill,
        )

    def create_lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    def create_parallel_config(self) -> ParallelConfig:
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        return ParallelConfig(self.tensor_parallel_size, backend)

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        max_batched = self.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs
        )
        chunked = self.enable_chunked_prefill is not False
        if not chunked and max_batched < max_model_len:
            # Whole prompts only: a step must hold the longest one (vLLM raises the default
            # the same way).
            if self.max_num_batched_tokens is not None:
                logger.warning(
                    "Chunked prefill is off: max_num_batched_tokens raised from %d to "
                    "max_model_len (%d) so that every prompt fits one step.",
                    max_batched,
                    max_model_len,
                )
            max_batched = max_model_len
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            enable_chunked_prefill=chunked,
            async_scheduling=self.async_scheduling,
        )


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters the engine serves (enable_lora): slots on the model's linear layers."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name); the engine core always runs in its own process."""

    enable_log_requests: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The model as both sides of the engine need it; the HF config travels with it."""

    model: str  # resolved local path: a directory or a .gguf file
    tokenizer: str
    hf_config: object
    dtype: str  # "float32", "bfloat16" or "float16"
    max_model_len: int
    seed: int = 0
    # "gguf": GGUF weights kept in their blocks; None: plain (dequantized) weights
    quantization: str | None = None
    load_format: str = "auto"  # "dummy": random weights, nothing read (see EngineArgs)
    # No graphs: every step runs the model's forward (on the CPU: no replayed decode steps).
    enforce_eager: bool = False
    generation_config: str = "auto"  # see EngineArgs
    runner_type: str = "generate"  # "generate" or "pooling" (resolved from EngineArgs.runner)
    pooler_config: PoolerConfig | None = None  # resolved (no None fields) when pooling

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def is_matryoshka(self) -> bool:
        """Whether the embeddings may be cut to fewer dimensions (vLLM reads the same keys)."""
        config = self.hf_config
        return bool(
            getattr(config, "is_matryoshka", False)
            or getattr(config, "matryoshka_dimensions", None)
        )

    @property
    def pooling_task(self) -> str:
        """What the pooling runner computes: "classify" for a sequence classifier, else
        "embed"."""
        return "classify" if is_sequence_classifier(self.hf_config) else "embed"

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks a request may ask of this model: a sequence classifier also
        scores text pairs, as a cross-encoder (vLLM's "score" task)."""
        return ("classify", "score") if self.pooling_task == "classify" else ("embed",)

    @property
    def is_cross_encoder(self) -> bool:
        """Whether LLM.score and /score run each text pair through the model as one prompt
        (a sequence classifier) rather than compare two embeddings (vLLM's name)."""
        return self.pooling_task == "classify"

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling parameters generation_config.json sets (vLLM's method of the same
        name): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
        max_tokens. Empty with generation_config "vllm", or when there is no such file (a
        GGUF file has none)."""
        return dict(self._sampling_defaults)

    @functools.cached_property
    def _sampling_defaults(self) -> dict[str, Any]:
        # Read once: LLM.generate() without sampling params asks at every call.
        from minivllm.model.loader import load_generation_config

        if self.generation_config == "vllm":
            return {}
        folder = self.model if self.generation_config == "auto" else self.generation_config
        names = {name: name for name in _GENERATION_CONFIG_SAMPLING}
        names["max_new_tokens"] = "max_tokens"
        config = load_generation_config(folder)
        return {names[k]: v for k, v in config.items() if k in names and v is not None}


@dataclass(frozen=True)
class VllmConfig:
    """Everything the engine core needs to build itself."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str = "cpu"
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig | None = None  # None: no adapters served
    speculative_config: SpeculativeConfig | None = None  # None: a token a step

    @property
    def quant_config(self) -> QuantizationConfig | None:
        """The weight format that picks each linear layer's method (model_config's
        ``quantization``); None: dense weights. Built where the model is (torch is imported
        there, not by the engine core's bookkeeping)."""
        from minivllm.model.layers.quantization import get_quantization_config

        return get_quantization_config(self.model_config.quantization)
