"""From the user's engine arguments and the model's files to a VllmConfig: every rule.

The one config module that reads the model's files (``model/``) and asks the device
(``platforms/``); ``EngineArgs`` (``engine/arg_utils.py``) holds the options themselves,
``config.py`` the frozen configs this builds.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from minivllm.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
    is_sequence_classifier,
    json_object,
)
from minivllm.engine.arg_utils import ONLINE_QUANTIZATIONS, TASKS, EngineArgs
from minivllm.kv_offload.identity import disk_cache_fields
from minivllm.model.layers.rotary import max_positions
from minivllm.model.loader import (
    is_gguf,
    load_generation_config,
    load_hf_config,
    resolve_model_path,
)
from minivllm.model.loader.pooling import checkpoint_pooling, has_pooling_type
from minivllm.model.sources import resolve_model_source, source_defaults
from minivllm.platforms import get_platform
from minivllm.platforms.interface import Platform

logger = logging.getLogger(__name__)


def check_engine_args(args: EngineArgs) -> None:
    """Raise ValueError on a value an option does not take (its field's metadata) or on
    options that do not combine, before anything is read."""
    args.validate()
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(
        os.path.expanduser(args.generation_config)
    ):
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder, got {args.generation_config!r}."
        )
    if args.load_format == "dummy" and args.quantization not in (None, "none"):
        raise ValueError(
            f"load_format='dummy' makes plain weights; quantization={args.quantization!r} "
            "needs the checkpoint's own."
        )
    backend = args.distributed_executor_backend
    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.async_scheduling and (workers > 1 or backend not in (None, "uni")):
        raise ValueError(
            "async_scheduling runs one worker in the engine core's process: "
            "tensor_parallel_size=1, pipeline_parallel_size=1 and distributed_executor_backend "
            "'uni'."
        )
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(
            f"max_cpu_loras ({args.max_cpu_loras}) must be at least max_loras ({args.max_loras})."
        )
    if SpeculativeConfig.parse(args.speculative_config) is not None and args.async_scheduling:
        raise ValueError(
            "speculative_config and async_scheduling do not combine: a step's proposals "
            "come from its accepted tokens, which async scheduling has not read yet."
        )
    if backend == "uni" and workers > 1:
        raise ValueError(
            "distributed_executor_backend='uni' runs one worker; use 'mp' or 'ray' for "
            f"tensor_parallel_size={args.tensor_parallel_size} x "
            f"pipeline_parallel_size={args.pipeline_parallel_size}."
        )
    check_pipeline_args(args)


def default_async_scheduling(args: EngineArgs, platform: Platform) -> bool:
    """vLLM's default on CUDA: on where it combines (one worker, no proposals), on a device
    apart from the host. On the CPU the host is the device: no device work to overlap."""
    return (
        not platform.host_is_device
        and args.tensor_parallel_size * args.pipeline_parallel_size == 1
        and args.distributed_executor_backend in (None, "uni")
        and SpeculativeConfig.parse(args.speculative_config) is None
    )


def check_pipeline_model(hf_config) -> None:
    """Raise ValueError for a model class that cannot be built one stage at a time."""
    from minivllm.model.registry import resolve_model_class  # the model code, only here

    model_cls = resolve_model_class(hf_config)
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"{model_cls.__name__} does not support pipeline parallelism: use "
            "pipeline_parallel_size=1 (tensor parallelism may split it instead)."
        )


def check_pipeline_args(args: EngineArgs) -> None:
    """What pipeline stages do not run: a step's features that need every layer's output
    in one place, or its outputs before the next step is scheduled."""
    if args.pipeline_parallel_size == 1:
        return
    refused = [
        (SpeculativeConfig.parse(args.speculative_config) is not None, "speculative_config"),
        (args.enable_lora, "enable_lora"),
        (args.scheduling_policy == "slo", "scheduling_policy='slo' (its step-time model)"),
    ]
    for on, what in refused:
        if on:
            raise ValueError(f"pipeline_parallel_size > 1 does not support {what}.")


def is_mxfp4_checkpoint(hf_config) -> bool:
    """A Hugging Face checkpoint with MXFP4 weights (gpt-oss's experts, as released)."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def resolve_quantization(
    requested: str | None,
    path: str,
    platform: Platform,
    dtype: str = "float32",
    mxfp4: bool = False,
) -> str | None:
    """ "gguf" (keep the GGUF blocks, int8 kernels) or None (dequantize to plain weights).

    "none" dequantizes at load, whose greedy outputs equal HF transformers' (int8
    activations do not always: near-ties flip). None (vLLM's "infer it") keeps a .gguf
    file's blocks where the platform runs them (the CPU, float32, the kernels built: about
    half the CPU time per decoded token of the float32 path on the bundled model, with
    perplexity within 0.4% of it). mxfp4: a Hugging Face checkpoint whose MXFP4 matrices
    the same kernels keep ("mxfp4", vLLM's name, asks for it). q8_0, q4_0, ...: online
    quantization of a float checkpoint (resolve_online_quantization)."""
    if requested == "none":
        return None
    if requested in ONLINE_QUANTIZATIONS:
        return resolve_online_quantization(requested, platform, dtype)
    kept = path.endswith(".gguf") or mxfp4
    runs_here = "gguf" in platform.supported_quantization and dtype == "float32"
    if requested is None and not (kept and runs_here):
        return None
    if requested == "mxfp4" and not mxfp4:
        raise ValueError(f"quantization='mxfp4' needs an MXFP4 checkpoint, got {path}")
    if not kept:
        raise ValueError(f"quantization='gguf' needs a .gguf model, got {path}")
    if not runs_here:
        raise ValueError(
            "quantization='gguf' runs on the CPU in float32; use device='cpu' and "
            "dtype='float32', or quantization='none'"
        )
    from minivllm.kernels.gguf_kernels import load_gguf_kernels

    if load_gguf_kernels() is None:  # no compiler: dequantize as before
        if requested == "gguf":
            raise RuntimeError("quantization='gguf' needs the GGUF kernels (a C compiler)")
        return None
    return "gguf"


def resolve_online_quantization(requested: str, platform: Platform, dtype: str) -> str:
    """q8_0, q4_0, ...: a float checkpoint (HF directory or float GGUF) quantized at load
    to those GGUF blocks, which only the GGUF kernels run: the CPU, float32 activations."""
    if "gguf" not in platform.supported_quantization or dtype != "float32":
        raise ValueError(
            f"quantization={requested!r} runs on the CPU in float32 (the GGUF kernels); use "
            "device='cpu' and dtype='float32' or 'auto', or quantization='none'"
        )
    from minivllm.kernels.gguf_kernels import load_gguf_kernels

    if load_gguf_kernels() is None:
        raise RuntimeError(f"quantization={requested!r} needs the GGUF kernels (a C compiler)")
    return requested


def resolve_runner(args: EngineArgs, hf_config, path: str) -> str:
    """ "generate" or "pooling": the runner asked for (or the older task's), else vLLM's rule
    by the architecture's name: "...ForCausalLM" generates, a bare "...Model" (the
    checkpoint of an embedding model: Qwen3Model, LlamaModel) pools; a GGUF file that
    names a pooling type (llama.cpp's embedding models) pools too."""
    runner = args.runner if args.runner != "auto" else TASKS[args.task]
    if runner == "auto":
        arch = (getattr(hf_config, "architectures", None) or [""])[0]
        bare_model = arch.endswith("Model") and not arch.endswith("LMHeadModel")
        pools = bare_model or is_sequence_classifier(hf_config) or has_pooling_type(path)
        runner = "pooling" if pools else "generate"
    if runner == "generate" and args.convert == "embed":
        runner = "pooling"  # vLLM's --convert embed asks for the pooling runner
    return runner


def resolve_pooler_config(args: EngineArgs, path: str, classifier: bool = False) -> PoolerConfig:
    """Every field set: the user's, else the checkpoint's, else LAST and normalized (vLLM's
    defaults for a generative architecture turned into an embedding model). A classifier
    reads the last token's hidden state as it is (HF's sequence classification)."""
    asked = PoolerConfig.parse(args.pooler_config) or PoolerConfig()
    if classifier:
        return PoolerConfig(pooling_type=asked.pooling_type or "LAST", normalize=False)
    pooling_type, normalize = checkpoint_pooling(path)
    return PoolerConfig(
        pooling_type=asked.pooling_type or pooling_type or "LAST",
        normalize=next(v for v in (asked.normalize, normalize, True) if v is not None),
    )


def create_vllm_config(args: EngineArgs) -> VllmConfig:
    """Resolve the model and derive every config from the user's engine arguments."""
    check_engine_args(args)
    platform = get_platform(args.device)
    if args.async_scheduling is None:
        args = dataclasses.replace(args, async_scheduling=default_async_scheduling(args, platform))
    path = resolve_model_path(
        resolve_model_source(
            args.model,
            revision=args.revision,
            download_dir=args.download_dir,
            hf_file=args.hf_file,
        )
    )
    hf_config = load_hf_config(path)
    model_max_len = max_positions(hf_config)  # max_position_embeddings, RoPE-scaled
    # An Ollama manifest's num_ctx and sampling parameters are its defaults, as a
    # checkpoint's generation_config.json's are (the user's options over both).
    store_sampling, store_context = source_defaults(args.model)
    max_model_len = args.max_model_len or min(store_context or model_max_len, model_max_len)
    if max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than the model's maximum context "
            f"length of {model_max_len} (max_position_embeddings, with RoPE scaling)."
        )
    is_gguf_file = is_gguf(path)
    if args.load_format in ("safetensors", "gguf") and (args.load_format == "gguf") != is_gguf_file:
        raise ValueError(f"load_format={args.load_format!r} does not read {path}")
    runner = resolve_runner(args, hf_config, path)
    pooler_config = None
    if runner == "pooling":
        pooler_config = resolve_pooler_config(args, path, is_sequence_classifier(hf_config))
    dtype = platform.resolve_dtype(args.dtype, hf_config)
    mxfp4 = is_mxfp4_checkpoint(hf_config)
    if mxfp4 and args.dtype == "auto" and "gguf" in platform.supported_quantization:
        dtype = "float32"  # as for a GGUF file: float32 activations, the MXFP4 blocks kept
    online = args.quantization in ONLINE_QUANTIZATIONS
    if online and args.dtype == "auto" and "gguf" in platform.supported_quantization:
        dtype = "float32"  # a bf16 checkpoint too: its blocks run with float32 activations
    model_config = ModelConfig(
        model=path,
        tokenizer=resolve_model_path(
            resolve_model_source(
                args.tokenizer, revision=args.tokenizer_revision, download_dir=args.download_dir
            )
        )
        if args.tokenizer
        else path,
        hf_config=hf_config,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        quantization=None
        if args.load_format == "dummy"  # plain random weights, whatever the file holds
        else resolve_quantization(args.quantization, path, platform, dtype, mxfp4),
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        runner_type=runner,
        pooler_config=pooler_config,
        sampling_defaults=read_sampling_defaults(
            args.generation_config, path, args.override_generation_config, store_sampling
        ),
    )
    defaults = model_config.get_diff_sampling_param()
    if defaults:
        logger.info(
            "Default sampling parameters from the model's generation_config.json (or Ollama "
            "manifest): %s "
            "(generation_config='vllm' keeps vLLM's own).",
            defaults,
        )
    scheduler_config = create_scheduler_config(args, max_model_len)
    speculative_config = SpeculativeConfig.parse(args.speculative_config)
    if speculative_config is not None and runner == "pooling":
        raise ValueError("speculative_config needs a generative model; this one pools.")
    if runner == "pooling":  # nothing is sampled: no step waits on a previous one
        scheduler_config = dataclasses.replace(scheduler_config, async_scheduling=False)
        if args.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size > 1 needs a generative model; this pools.")
    parallel_config = create_parallel_config(args)
    parallel_config.verify_with_model(hf_config)
    if parallel_config.pipeline_parallel_size > 1:
        check_pipeline_model(hf_config)
    cache_config = create_cache_config(args, platform, model_config)
    if pooler_config is not None:
        cache_config = pooling_cache_config(cache_config, pooler_config)
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device=platform.device_type,
        parallel_config=parallel_config,
        lora_config=create_lora_config(args),
        speculative_config=speculative_config,
        structured_outputs_config=StructuredOutputsConfig.parse(args.structured_outputs_config),
    )


# The generation_config.json fields that become default sampling parameters, as in vLLM
# (max_new_tokens as max_tokens).
_GENERATION_CONFIG_SAMPLING = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def read_sampling_defaults(
    generation_config: str,
    model_path: str,
    overrides: dict | str | None = None,
    store_defaults: dict | None = None,
) -> dict:
    """The default sampling parameters generation_config says (see EngineArgs): none for
    "vllm", else those of the model's folder ("auto") or the given folder's
    generation_config.json (none without one: a GGUF file has none); then ``overrides``
    (override_generation_config, in the file's names) over them, as vLLM. With "auto",
    ``store_defaults`` (SamplingParams fields an Ollama manifest sets) under both."""
    config = {}
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else generation_config
        config = load_generation_config(os.path.expanduser(folder))
    names = _GENERATION_CONFIG_SAMPLING
    if overrides is not None:
        config |= json_object("override_generation_config", overrides, set(names))
    defaults = dict(store_defaults or {}) if generation_config == "auto" else {}
    return defaults | {names[k]: v for k, v in config.items() if k in names and v is not None}


def create_cache_config(
    args: EngineArgs, platform: Platform, model_config: ModelConfig | None = None
) -> CacheConfig:
    kv_bytes = args.kv_cache_memory_bytes
    if kv_bytes is None:
        kv_bytes = platform.default_kv_cache_memory_bytes()
    return CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        kv_cache_memory_bytes=kv_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        **disk_cache_fields(args, model_config) if model_config is not None else {},
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_sharing_fast_prefill=args.kv_sharing_fast_prefill,
    )


def pooling_cache_config(cache_config: CacheConfig, pooler_config: PoolerConfig) -> CacheConfig:
    """A pooling model's cache: prefix caching only for LAST pooling (a cached prefix's
    hidden states are never computed, and only the last token's are needed; vLLM's rule
    too), and no fast prefill (every row's hidden state may be pooled)."""
    caching = cache_config.enable_prefix_caching and pooler_config.pooling_type == "LAST"
    if caching != cache_config.enable_prefix_caching:
        logger.info(
            "Prefix caching is off: %s pooling reads every prompt token's hidden state.",
            pooler_config.pooling_type,
        )
    return dataclasses.replace(
        cache_config, enable_prefix_caching=caching, kv_sharing_fast_prefill=False
    )


def create_lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)


def create_parallel_config(args: EngineArgs) -> ParallelConfig:
    backend = args.distributed_executor_backend
    if backend is None:
        workers = args.tensor_parallel_size * args.pipeline_parallel_size
        backend = "uni" if workers == 1 else "mp"
    return ParallelConfig(
        args.tensor_parallel_size,
        backend,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )


def create_scheduler_config(args: EngineArgs, max_model_len: int) -> SchedulerConfig:
    max_batched = args.max_num_batched_tokens or max(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs
    )
    chunked = args.enable_chunked_prefill is not False
    if not chunked and max_batched < max_model_len:
        # Whole prompts only: a step must hold the longest one (vLLM raises the default
        # the same way).
        if args.max_num_batched_tokens is not None:
            logger.warning(
                "Chunked prefill is off: max_num_batched_tokens raised from %d to "
                "max_model_len (%d) so that every prompt fits one step.",
                max_batched,
                max_model_len,
            )
        max_batched = max_model_len
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        policy=args.scheduling_policy,
        enable_chunked_prefill=chunked,
        async_scheduling=bool(args.async_scheduling),
        default_slo_tpot=args.default_slo_tpot,
        default_slo_ttft=args.default_slo_ttft,
    )
