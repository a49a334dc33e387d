"""LLMEngine: vLLM's synchronous engine API over an engine core client.

By default the engine core runs in its own process (SyncMPClient): while it computes a
step, this process detokenizes the previous one. ``enable_multiprocessing=False`` or
``MINIVLLM_ENABLE_MULTIPROCESSING=0`` keeps it in this process (InprocClient).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from minivllm.config import (
    TASKS,
    CacheConfig,
    EngineArgs,
    ModelConfig,
    PoolerConfig,
    SpeculativeConfig,
    VllmConfig,
    is_sequence_classifier,
    multiprocessing_default,
)
from minivllm.engine.core_client import EngineCoreClient, MPClient, start_engine_core
from minivllm.engine.messages import SchedulerStats
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import fan_out
from minivllm.engine.processor import Processor, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.model.layers.rotary import max_positions
from minivllm.model.loader import is_gguf, load_hf_config, resolve_model_path
from minivllm.model.loader.pooling import checkpoint_pooling, has_pooling_type
from minivllm.model.sources import resolve_model_source
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.platforms import get_platform
from minivllm.platforms.interface import Platform
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# quantization=None on a .gguf model: keep its blocks (True, vLLM's behaviour) or dequantize.
INFER_GGUF = True


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
    the same kernels keep ("mxfp4", vLLM's name, asks for it)."""
    if requested == "none":
        return None
    kept = path.endswith(".gguf") or mxfp4
    runs_here = "gguf" in platform.supported_quantization and dtype == "float32"
    if requested is None and not (INFER_GGUF and kept and runs_here):
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
    args.validate()
    platform = get_platform(args.device)
    path = resolve_model_path(resolve_model_source(args.model))
    hf_config = load_hf_config(path)
    model_max_len = max_positions(hf_config)  # max_position_embeddings, RoPE-scaled
    max_model_len = args.max_model_len or model_max_len
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
    model_config = ModelConfig(
        model=path,
        tokenizer=resolve_model_path(resolve_model_source(args.tokenizer))
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
        generation_config=args.generation_config
        if args.generation_config in ("auto", "vllm")
        else os.path.expanduser(args.generation_config),
        runner_type=runner,
        pooler_config=pooler_config,
    )
    defaults = model_config.get_diff_sampling_param()
    if defaults:
        logger.info(
            "Default sampling parameters from the model's generation_config.json: %s "
            "(generation_config='vllm' keeps vLLM's own).",
            defaults,
        )
    scheduler_config = args.create_scheduler_config(max_model_len)
    speculative_config = SpeculativeConfig.parse(args.speculative_config)
    if speculative_config is not None and runner == "pooling":
        raise ValueError("speculative_config needs a generative model; this one pools.")
    if runner == "pooling":  # nothing is sampled: no step waits on a previous one
        scheduler_config = dataclasses.replace(scheduler_config, async_scheduling=False)
    parallel_config = args.create_parallel_config()
    parallel_config.verify_with_model(hf_config)
    cache_config = args.create_cache_config(platform)
    if pooler_config is not None:
        cache_config = pooling_cache_config(cache_config, pooler_config)
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device=platform.device_type,
        parallel_config=parallel_config,
        lora_config=args.create_lora_config(),
        speculative_config=speculative_config,
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


class LLMEngine:
    def __init__(
        self,
        vllm_config: VllmConfig,
        tokenizer=None,
        multiprocess_mode: bool | None = None,
        engine_core: MPClient | None = None,
    ) -> None:
        """tokenizer None: load the model's; multiprocess_mode None: from the environment;
        engine_core: a core process started before the config (``start_engine_core``)."""
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_default()
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.last_stats: SchedulerStats | None = None
        # A multiprocess core loads the model in its own process while the tokenizer loads.
        if engine_core is None:
            self.engine_core = EngineCoreClient.make_client(vllm_config, multiprocess_mode)
        else:
            engine_core.configure(vllm_config)
            self.engine_core = engine_core
        try:
            if tokenizer is None:
                tokenizer = load_tokenizer(self.model_config.tokenizer)
            self.engine_core.wait_for_ready()
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.tokenizer = tokenizer
        # What the model's weights take, as the start-up log says: "gguf" (blocks kept) or
        # "none", and the bytes of every rank's weights together.
        self.quantization: str = self.model_config.quantization or "none"
        self.weight_memory_bytes: int = self.engine_core.weight_memory_bytes
        self.processor = Processor(
            self.model_config,
            tokenizer,
            vllm_config.scheduler_config.policy,
            vllm_config.lora_config,
        )
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, engine_core: MPClient | None = None
    ) -> LLMEngine:
        """engine_core: the core process started for these arguments (by LLM, before its
        imports); else one is started here, and imports while the config is built."""
        if engine_core is None:
            engine_core = start_engine_core(engine_args)
        try:
            config = create_vllm_config(engine_args)
        except BaseException:
            if engine_core is not None:
                engine_core.shutdown()
            raise
        return cls(
            config, multiprocess_mode=engine_args.use_multiprocessing(), engine_core=engine_core
        )

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if self.output_processor.is_active(request_id):
            raise ValueError(f"Request id {request_id} is already running.")
        prompt_text, request = self.processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        parent, core_requests = fan_out(request)
        for core_request in core_requests:
            self.output_processor.add_request(
                core_request.request_id,
                prompt_text,
                core_request.prompt_token_ids,
                core_request.pooling_params or core_request.sampling_params,
                parent=parent,
            )
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        known = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(known)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the core's next step; raises EngineDeadError if the core died.

        With nothing running it returns at once, after refreshing ``last_stats``.
        """
        if not self.output_processor.has_unfinished_requests():
            self.last_stats = self.engine_core.get_stats()
            return []
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        """The scheduler's statistics now, asked of the engine core."""
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the engine now, as vLLM's: a request naming it later
        finds it loaded. ValueError: the engine cannot serve it."""
        self.processor.validate_lora(lora_request)
        return self.engine_core.add_lora(lora_request)

    def start_profile(self) -> None:
        """Start a torch.profiler trace of the engine core (needs VLLM_TORCH_PROFILER_DIR)."""
        self.engine_core.profile(True)

    def stop_profile(self) -> None:
        """Stop the trace and write it into the profiler folder."""
        self.engine_core.profile(False)

    def shutdown(self) -> None:
        """Stop the engine core (and its process). Also done when the engine is collected."""
        self.engine_core.shutdown()

    def __del__(self) -> None:
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
