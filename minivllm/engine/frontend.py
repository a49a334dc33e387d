"""What LLMEngine and AsyncLLM both do: start over an engine core, and turn a request into
the engine core's requests (checked, tokenized, fanned out for n > 1) that the output
processor then follows."""

from __future__ import annotations

import asyncio
import contextlib

from minivllm.config import VllmConfig
from minivllm.core.slo_policy import SLOAdmission
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import EngineCoreClient, MPClient, start_engine_core
from minivllm.engine.create_config import create_vllm_config
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.parallel_sampling import fan_out
from minivllm.engine.processor import Processor, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.tokenizer import load_tokenizer


def config_with_core(
    engine_args: EngineArgs, engine_core: MPClient | None, asyncio_mode: bool
) -> tuple[VllmConfig, MPClient | None]:
    """The VllmConfig for ``engine_args``, built while the engine core's process (started
    here unless given, None where the core runs in this process) imports; the core is
    stopped if the config fails."""
    if engine_core is None:
        engine_core = start_engine_core(engine_args, asyncio_mode=asyncio_mode)
    try:
        return create_vllm_config(engine_args), engine_core
    except BaseException:
        if engine_core is not None:
            engine_core.shutdown()
        raise


class EngineFrontend:
    """The request side both engines share: the config, the tokenizer, the Processor that
    checks and tokenizes requests and the OutputProcessor that follows them."""

    engine_core: EngineCoreClient

    def _start(self, vllm_config: VllmConfig, engine_core: EngineCoreClient, tokenizer) -> None:
        """Keep ``engine_core`` and wait until it is ready; the tokenizer (the model's when
        None) loads meanwhile. A failure stops the core."""
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.engine_core = engine_core
        try:
            if tokenizer is None:
                tokenizer = load_tokenizer(self.model_config.tokenizer)
            engine_core.wait_for_ready()
        except BaseException:
            engine_core.shutdown()
            raise
        self.tokenizer = tokenizer
        self.processor = Processor(
            self.model_config,
            tokenizer,
            vllm_config.scheduler_config.policy,
            vllm_config.lora_config,
        )
        self.processor.slo_admission = SLOAdmission.for_engine(
            vllm_config.scheduler_config, engine_core.step_time_model
        )
        self.output_processor = OutputProcessor(tokenizer)

    def _core_requests(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None,
        queue: asyncio.Queue | None = None,
        prompt_text: str | None = None,
    ) -> list[EngineCoreRequest]:
        """The engine core's requests for one request (n of them for n samples), each
        followed by the output processor (its outputs go to ``queue``, if given). prompt:
        also an EngineCoreRequest the caller checked with ``processor.process_inputs``."""
        if self.output_processor.is_active(request_id):
            raise ValueError(f"Request id {request_id} is already running.")
        if isinstance(prompt, EngineCoreRequest):  # processed by the caller (vLLM's server)
            request = prompt
        else:
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
                queue=queue,
                parent=parent,
            )
        return core_requests

    @contextlib.contextmanager
    def _sending(self, request_id: str):
        """Around sending a request's core requests: if one fails to reach the core (an
        encoder's error, say), the request is no longer followed, or its outputs would be
        waited for forever (the next LLM.generate() stepped without end)."""
        try:
            yield
        except BaseException:
            self._abort_requests([request_id])
            raise

    def _abort_requests(self, request_ids: list[str]) -> list[str]:
        """Stop following the requests (and their samples); the core aborts them too.
        Returns the core's request ids aborted."""
        core_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)
        return core_ids
