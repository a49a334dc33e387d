"""The frozen configs the engine is built from (VllmConfig and its parts).

engine/arg_utils.py holds the user's options (EngineArgs), engine/create_config.py the
rules from them and the model's files to these configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The devices the engine runs on ("auto": CUDA when torch sees a GPU, else the CPU).
DEVICES = ("auto", "cpu", "cuda")


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
    # What the KV cache holds (attention/kv_quant.py): one of KV_CACHE_DTYPES.
    kv_cache_dtype: str = "auto"
    # The persistent prefix cache on disk (kv_offload/): its folder (None: off), its bound,
    # the model identity its files are keyed by (hex), and the ranks that each keep a file.
    kv_cache_disk: str | None = None
    kv_cache_disk_bytes: int = 10 << 30
    kv_cache_disk_key: str = ""
    kv_cache_disk_ranks: int = 1


# --kv-cache-dtype's values: vLLM's names, and the 8-bit layouts of the CPU
# (attention/kv_quant.py says what each stores); an alias names the layout it stands for.
KV_CACHE_DTYPES = (
    "auto",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "fp16k_int8v",
    "int8k_int8v",
    "fp16k_e4m3v",
    "fp16k_e5m2v",
    "e4m3k_e4m3v",
    "e5m2k_e5m2v",
)
KV_CACHE_DTYPE_ALIASES = {
    "fp8": "fp16k_e4m3v",
    "fp8_e4m3": "fp16k_e4m3v",
    "fp8_e5m2": "fp16k_e5m2v",
    "int8": "fp16k_int8v",
}

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
    # The SLO targets (seconds) of a latency-sensitive request that sets none (policy "slo").
    default_slo_tpot: float | None = None
    default_slo_ttft: float | None = None


POOLING_TYPES = ("LAST", "MEAN", "CLS")
# A classifier checkpoint's architecture ends so: the network and a `score` head of
# num_labels outputs over the last token's hidden state, run by the pooling runner.
SEQUENCE_CLASSIFIER = "ForSequenceClassification"


def is_sequence_classifier(hf_config) -> bool:
    architectures = getattr(hf_config, "architectures", None) or [""]
    return architectures[0].endswith(SEQUENCE_CLASSIFIER)


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
class StructuredOutputsConfig:
    """How grammars are built from JSON schemas (vLLM's --structured-outputs-config)."""

    # A JSON string with no maxLength (in a schema, json_object, or an object's keys) holds
    # at most this many characters, and at most a quarter of the request's max_tokens (a
    # character can cost a token: one string that runs to its cap leaves room for the rest
    # of the object); 0: unbounded, as xgrammar writes it. Unbounded, a small sampled model
    # can repeat itself inside one string until max_tokens, and the reply is not JSON. 256
    # keeps a few sentences; a schema's own maxLength, larger or smaller, is kept as
    # written. The grammar grows by a rule per character (about 10 ms of compile time each
    # for a 49k vocabulary, once per distinct schema and cap).
    json_max_string_length: int = 256

    @classmethod
    def parse(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """From a StructuredOutputsConfig, a dict, or its JSON text; None: the defaults."""
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        value = json_object("structured_outputs_config", value, {"json_max_string_length"})
        length = value.get("json_max_string_length", cls.json_max_string_length)
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ValueError(
                "structured_outputs_config: json_max_string_length must be an integer >= 0 "
                f"(0: unbounded), not {length!r}."
            )
        return cls(json_max_string_length=length)


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
    """How the model is split: pipeline_parallel_size stages of consecutive layers, each
    over tensor_parallel_size ranks, run by which executor; and how many engine cores
    (data_parallel_size replicas, each with its own scheduler and KV cache) serve it."""

    tensor_parallel_size: int = 1
    # "uni": one worker in the engine core's process; "mp": one process per rank on this
    # machine; "ray": one Ray actor per rank, on a Ray cluster.
    distributed_executor_backend: str = "uni"
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # Which engine core (replica) of data_parallel_size this config is given to.
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        """The workers of one engine core: a rank is stage * tensor_parallel_size + its
        tensor-parallel rank."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify_with_model(self, hf_config) -> None:
        """Raise ValueError when the model cannot be split into tensor_parallel_size ranks
        or pipeline_parallel_size stages."""
        pp = self.pipeline_parallel_size
        layers = getattr(hf_config, "num_hidden_layers", None)
        if pp > 1 and layers is not None and pp > layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} is more stages than the model's {layers} "
                "layers (num_hidden_layers): each stage must hold at least one layer."
            )
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


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters the engine serves (enable_lora): slots on the model's linear layers."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(frozen=True)
class ModelConfig:
    """The model as both sides of the engine need it; the HF config travels with it."""

    model: str  # resolved local path: a directory or a .gguf file
    tokenizer: str
    hf_config: object
    dtype: str  # "float32", "bfloat16" or "float16"
    max_model_len: int
    seed: int = 0
    # "gguf": GGUF weights kept in their blocks; "q8_0", "q4_0", ...: a float checkpoint
    # quantized at load to those blocks (online); None: plain (dequantized) weights
    quantization: str | None = None
    load_format: str = "auto"  # "dummy": random weights, nothing read (see EngineArgs)
    # No graphs: every step runs the model's forward (on the CPU: no replayed decode steps).
    enforce_eager: bool = False
    runner_type: str = "generate"  # "generate" or "pooling" (resolved from EngineArgs.runner)
    pooler_config: PoolerConfig | None = None  # resolved (no None fields) when pooling
    # What get_diff_sampling_param answers: read once from generation_config.json (while
    # the config is created), as LLM.generate() without sampling params asks at every call.
    sampling_defaults: dict[str, Any] = field(default_factory=dict, compare=False)

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
        return dict(self.sampling_defaults)


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
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
