"""The one bridge between scheduler bookkeeping and tensors: batch in, sampled ids out.

``_execute_model`` is the step; the features it carries (prompt logprobs, speculative
decoding, LoRA, pooling, a hybrid model's state cache, async scheduling) enter it through
the hooks of ``step.py``, each in its own module.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm import envs
from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.config import SchedulerConfig
from minivllm.core.sched_output import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from minivllm.distributed.parallel_state import PPGroup, TPGroup
from minivllm.engine.profiler import profile_range
from minivllm.platforms import get_platform
from minivllm.sample.sampler import Sampler, SamplerOutput, greedy_ids
from minivllm.worker import cpu_graph
from minivllm.worker.async_scheduling import AsyncScheduling
from minivllm.worker.cpu_graph import CPUGraph
from minivllm.worker.cuda_graph import CudaGraphRunner, GraphOutput
from minivllm.worker.device_buffers import capture_sizes
from minivllm.worker.fast_prefill import fast_prefill_inputs
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.lora_step import LoRAStep
from minivllm.worker.pipeline_stage import PipelineStageStep
from minivllm.worker.pooler import Pooler, PoolingState
from minivllm.worker.pooling_step import PoolingStep
from minivllm.worker.prompt_logprobs import PromptLogprobs
from minivllm.worker.sampling_inputs import SamplingInputs
from minivllm.worker.spec_decode_step import SpecDecode
from minivllm.worker.state_cache_step import StateCacheStep
from minivllm.worker.step import CachedRequestState, RunnerStep, StepFeature, StepHooks
from minivllm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from minivllm.config import SpeculativeConfig
    from minivllm.lora.model_manager import LoRAModelManager
    from minivllm.model.layers.state_cache import StateCache

logger = logging.getLogger(__name__)


class ModelRunner:
    """With tensor parallelism every rank runs the same steps on the same requests; rank 0
    alone samples, and sends the sampled ids to the others (they feed the next step)."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        vocab_size: int,
        tp: TPGroup | None = None,
        scheduler_config: SchedulerConfig | None = None,
        *,
        attn_backend: AttentionBackend,
        enforce_eager: bool = False,
        device: torch.device | str = "cpu",
        kv_sharing_fast_prefill: bool = False,
        pooler: Pooler | None = None,
        lora_manager: LoRAModelManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        """pooler: the pooling runner's (every request is pooled, none sampled).
        lora_manager: the adapters' (enable_lora). speculative_config: proposals, checked
        by the next step. pp: this worker's pipeline stage (model is then its
        ``pipeline_stage.StageModel``); a stage before the last samples nothing."""
        self.model = model
        self.pp = pp if pp is not None else PPGroup()
        self.pooler = pooler
        self.lora_manager = lora_manager
        self.device = torch.device(device)
        self.platform = get_platform(self.device.type)
        self.attn_backend = attn_backend
        # Decode steps replayed as kernel calls (cpu_graph.py), by batch size (and graph
        # variant: RunnerStep.graph_variant); None: that one runs eagerly.
        self.cpu_graphs: dict[object, CPUGraph | None] | None = None
        if (
            envs.MINIVLLM_CPU_GRAPHS
            and not enforce_eager
            and isinstance(attn_backend, CPUAttentionBackend)
            and attn_backend.kernels is not None
            and hasattr(model, "embed_input_ids")
            and (tp is None or tp.size == 1)
            and pooler is None  # prompts only: no decode steps to replay
        ):
            self.cpu_graphs = {}
        self.tp = tp if tp is not None else TPGroup()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        sc = scheduler_config or SchedulerConfig()
        self.scheduler_config = sc
        self.enforce_eager = enforce_eager
        # Only for a model whose later layers read earlier ones' K/V (fast_prefill.py).
        self.kv_sharing_fast_prefill = (
            kv_sharing_fast_prefill and getattr(model, "shares_kv_cache", False) and pooler is None
        )
        # Decode steps replayed as CUDA graphs (``capture_model``, on a GPU); None: eager.
        self.cuda_graphs: CudaGraphRunner | None = None
        self.input_batch = InputBatch(
            sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens, block_size, self.device
        )
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded generators outlive preemption, so a resumed request keeps its random stream.
        self.generators: dict[str, torch.Generator] = {}
        self.sampling_inputs = SamplingInputs(self.input_batch, vocab_size, self.device)
        # Async scheduling: execute_model returns before the sampled ids reach the host.
        self.async_scheduling = sc.async_scheduling and pooler is None and self.tp.size == 1
        self.state_cache: StateCache | None = None  # a hybrid model's (set_state_cache)
        self.hooks = StepHooks(self._features(speculative_config))
        self.async_output: AsyncScheduling | None = self.hooks.of_type(AsyncScheduling)
        # _states_of's last answer: (the rows it was asked for, states).
        self._states_memo: tuple[np.ndarray, list[CachedRequestState]] | None = None

    def set_state_cache(self, state_cache: StateCache) -> None:
        """A hybrid model's state cache: each step tells it the requests' slots. A state
        cannot take back a rejected proposal's tokens: no speculative decoding with it."""
        if self.hooks.of_type(SpecDecode) is not None:
            raise ValueError("Speculative decoding does not support models with state layers.")
        self.state_cache = state_cache  # its states are put back after a graph's capture
        self.hooks = StepHooks([*self.hooks.features, StateCacheStep(state_cache, self.requests)])

    def _features(self, speculative_config: SpeculativeConfig | None) -> list[StepFeature]:
        """The step's features, in the order their hooks run."""
        features: list[StepFeature] = []
        if not self.pp.is_last:  # no logits here: the stage's part ends after its layers
            return [PipelineStageStep(self.input_batch)]
        if self.pooler is not None:
            features.append(PoolingStep(self.pooler, self.requests, self.tp))
        else:
            prompt_logprobs = PromptLogprobs(self.model, self.vocab_size, self.requests)
            features.append(prompt_logprobs)  # before spec decode: reads_all_rows
            if speculative_config is not None:
                spec = SpecDecode(
                    speculative_config, self.input_batch, prompt_logprobs.reqs, self.tp.is_first
                )
                features.append(spec)
        if self.lora_manager is not None:
            features.append(LoRAStep(self.lora_manager, self.requests))
        if self.async_scheduling:
            features.append(AsyncScheduling(self.input_batch, self.platform, self.generators))
        return features

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            if req_id not in so.preempted_req_ids:
                self.generators.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new)
            batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                new.block_ids,
                new.sampling_params,
            )
        if so.finished_req_ids or so.scheduled_new_reqs:
            for hook in self.hooks.update_states:
                hook(so)
        batch.condense()
        cached = so.scheduled_cached_reqs
        batch.update_cached(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        if seed is not None and new.req_id not in self.generators:
            # On the device the draws happen: a seeded row's numbers never leave it.
            generator = torch.Generator(device=self.device)
            self.generators[new.req_id] = generator.manual_seed(seed)
        wants_prompt_logprobs = new.sampling_params.prompt_logprobs is not None
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            generator=self.generators.get(new.req_id),
            output_ids=list(new.token_ids[new.num_prompt_tokens :]),
            prompt_logprobs=([], [], []) if wants_prompt_logprobs else None,
            pooling=PoolingState(new.pooling_params, new.num_prompt_tokens)
            if new.pooling_params is not None
            else None,
            lora_request=new.lora_request,
            state_slot=new.state_slot,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output = self._execute_model(so)
        if self.async_scheduling and isinstance(output, ModelRunnerOutput):
            return AsyncModelRunnerOutput.ready(output)
        return output

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step (step.py's docstring names its hooks)."""
        self._update_states(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput([], [])
        step = RunnerStep(so)
        batch = self.input_batch
        with profile_range("prepare_inputs"):
            for hook in self.hooks.prepare:
                hook(step)
            inputs = step.inputs = batch.prepare(
                step.req_ids,
                step.num_scheduled,
                step.in_flight,
                step.num_drafts,
                step.drafts_as_decode_rows,
                self.cuda_graphs.inputs if self.cuda_graphs is not None else None,
            )
            attn_metadata = self.attn_backend.build_metadata(common_metadata(inputs))
            for hook in self.hooks.before_forward:
                hook(step)
        with profile_range("forward"):
            hidden = step.hidden = self._forward(step, attn_metadata)
        for hook in self.hooks.after_forward:
            hook(step)
        batch.advance(inputs)
        if step.output is not None:
            return step.output
        if not len(inputs.sampling):
            req_ids = step.req_ids
            return ModelRunnerOutput(
                req_ids, [[] for _ in req_ids], prompt_logprobs=step.prompt_logprobs
            )
        if len(inputs.sampling) == len(step.req_ids):  # every request samples: a decode step
            sampling_rows = step.sampling_rows = inputs.rows
            states = step.states = self._states_of(step.req_ids, inputs.rows)
        else:
            sampling_rows = step.sampling_rows = inputs.rows[inputs.sampling]
            req_ids = step.req_ids
            states = step.states = [self.requests[req_ids[i]] for i in inputs.sampling.tolist()]
        # A logits row per sampling request; with proposals, one per proposed token too.
        row_states, rows = states, sampling_rows
        if inputs.num_logits is not None:
            counts = inputs.num_logits.tolist()
            row_states = [s for s, n in zip(states, counts) for _ in range(n)]
            rows = np.repeat(sampling_rows, inputs.num_logits)
        # A decode graph with the LM head computed every row's logits (a CUDA graph's, their
        # argmax too).
        graph = step.graph_output
        if graph is not None and graph.logits is None:
            graph = None
        # Every row samples, in order (one logits row per token of the step).
        graph_rows = graph is not None and len(row_states) == len(graph.logits)
        with profile_range("compute_logits"):
            if graph is None:
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
            else:
                logits = graph.logits if graph_rows else graph.logits[inputs.logits_indices]
        if logits is not None:
            with profile_range("sample"):
                meta = self.sampling_inputs.metadata(so, row_states, rows)
                if graph_rows and meta.plain_greedy:
                    greedy = graph.greedy  # the CUDA graph's argmax is the draw
                    out = SamplerOutput(greedy if greedy is not None else greedy_ids(logits))
                else:
                    out = self.sampler(logits, meta)
            sampled_ids = out.sampled_token_ids
        else:  # a tensor-parallel rank other than 0: rank 0's draw arrives below
            out = None
            sampled_ids = torch.empty(len(row_states), dtype=torch.long, device=self.device)
        tensors = [self.tp.broadcast_from_first(sampled_ids)]
        if out is not None and out.logprobs is not None:
            tensors += [out.logprob_token_ids, out.logprobs, out.sampled_ranks]
        if self.async_output is not None:
            return self.async_output.launch(step, tensors, self.hooks.after_sample, self._output)
        # The step's one wait for the device: the sampled ids (and logprobs, if asked).
        host = self._to_host(tensors)
        step.token_ids = host[0].tolist()
        for hook in self.hooks.after_sample:
            hook(step)
        if step.token_lists is None:
            batch.append_tokens(sampling_rows, host[0].numpy())
        else:
            batch.append_token_lists(sampling_rows, step.token_lists)
        return self._output(step, host[1:])

    def _states_of(self, req_ids: list[str], rows: np.ndarray) -> list[CachedRequestState]:
        """The requests' states, in order. ``rows`` is InputBatch.rows_of's answer, the same
        array as last step's for a steady batch (the same requests, no row changed hands):
        then the states are last step's too."""
        memo = self._states_memo
        if memo is not None and memo[0] is rows:
            return memo[1]
        requests = self.requests
        states = [requests[r] for r in req_ids]
        self._states_memo = (rows, states)
        return states

    def _output(self, step: RunnerStep, logprob_tensors: list[torch.Tensor]) -> ModelRunnerOutput:
        """The step's output from its sampled ids on the host (and the logprobs' tensors,
        if asked); each sampling request's state takes its tokens."""
        states = step.states
        token_lists = step.token_lists
        if token_lists is None:
            token_lists = [[t] for t in step.token_ids]
        for state, tokens in zip(states, token_lists):
            state.output_ids.extend(tokens)
        req_ids = step.req_ids
        if len(states) == len(req_ids):  # every request sampled, in order
            sampled_token_ids = token_lists
        else:
            sampled = {state.req_id: tokens for state, tokens in zip(states, token_lists)}
            sampled_token_ids = [sampled.get(r, []) for r in req_ids]
        logprobs = self._logprobs(step, logprob_tensors) if logprob_tensors else None
        output = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=[logprobs.get(r) for r in req_ids] if logprobs else None,
            prompt_logprobs=step.prompt_logprobs,
        )
        for hook in self.hooks.after_output:
            hook(step, output)
        return output

    def _logprobs(self, step: RunnerStep, logprob_tensors: list[torch.Tensor]) -> dict[str, tuple]:
        """req_id -> (ids, logprobs, rank) of its sampled token, for the requests that asked."""
        lp_ids, lp_values, ranks = (t.tolist() for t in logprob_tensors)
        logprob_rows = step.last_rows  # each state's row in the logprobs' tensors, if not i
        logprobs = {}
        for i, state in enumerate(step.states):
            k = state.sampling_params.logprobs
            if k is not None:  # such a request is never given proposals
                k = self.vocab_size if k == -1 else k
                j = i if logprob_rows is None else logprob_rows[i]
                logprobs[state.req_id] = (lp_ids[j][: 1 + k], lp_values[j][: 1 + k], ranks[j])
        return logprobs

    def capture_model(self) -> None:
        """On a GPU (unless enforce_eager), capture the decode steps' CUDA graphs; the KV
        cache must be bound already (the graphs read and write it in place)."""
        if not self.platform.supports_cuda_graphs or self.enforce_eager or self.pooler is not None:
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            logger.info("No CUDA graphs: %s routes tokens on the host.", type(self.model).__name__)
            return
        sc = self.scheduler_config
        self.cuda_graphs = CudaGraphRunner(
            self.model,
            self.attn_backend,
            capture_sizes(sc.max_num_seqs, sc.max_num_batched_tokens),
            sc.max_model_len,
            self.block_size,
            self.device,
            # The LM head too, where this process alone computes the logits.
            with_logits=self.tp.size == 1 and self.pp.is_last,
        )
        self.cuda_graphs.capture()

    def _forward(self, step: RunnerStep, attn_metadata) -> torch.Tensor:
        """The model on the step's inputs: eagerly, with the fast prefill, or a decode
        step's CUDA or CPU graph (captured at its first step of that shape)."""
        inputs = step.inputs
        if step.eager:
            return self.model(inputs.input_ids, inputs.positions, attn_metadata)
        batch = inputs.num_attn_rows  # requests, or tokens when proposals go as decode rows
        graph_key = batch
        if step.graph_variant is not None:
            graph_key = (batch, step.graph_variant)
        else:
            if (
                inputs.max_query_len > 1
                and self.kv_sharing_fast_prefill
                and not step.reads_all_rows
                and inputs.num_logits is None  # proposals' rows are read too: a step of them
            ):
                fast = fast_prefill_inputs(inputs, self.attn_backend, self.device)
                return self.model(
                    inputs.input_ids, inputs.positions, attn_metadata, fast_prefill=fast
                )
            if self.cuda_graphs is not None:
                step.graph_output = self.cuda_graphs.run(inputs)
                if step.graph_output is not None:
                    return step.graph_output.hidden
        graphs = self.cpu_graphs
        if (
            graphs is None
            or inputs.max_query_len != 1
            or batch > cpu_graph.MAX_BATCH
            or (graph_key in graphs and graphs[graph_key] is None)  # this one runs eagerly
        ):
            return self.model(inputs.input_ids, inputs.positions, attn_metadata)
        embeds = self.model.embed_input_ids(inputs.input_ids)
        if graph_key not in graphs:
            restore = self.state_cache.checkpoint() if self.state_cache is not None else None
            # The LM head too where this process samples, but not under an adapter's variant.
            with_logits = self.pp.is_last and step.graph_variant is None
            hidden, graphs[graph_key] = CPUGraph.capture(
                self.model, embeds, inputs.positions, attn_metadata, restore, with_logits
            )
            return hidden
        graph = graphs[graph_key]
        hidden = graph.replay(embeds, attn_metadata)
        if graph.logits is not None:
            step.graph_output = GraphOutput(hidden, graph.logits, None)
        return hidden

    def _to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors on the host, after one wait for the device (none on the CPU)."""
        if self.platform.host_is_device:
            return tensors
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        self.platform.synchronize()
        return host


def common_metadata(step: StepInputs) -> CommonAttentionMetadata:
    """The step's flat attention metadata: views of the InputBatch's buffers."""
    return CommonAttentionMetadata(
        query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        slot_mapping=step.slot_mapping,
        num_actual_tokens=step.num_tokens,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        query_start_loc_cpu=step.query_start_loc_cpu,
        seq_lens_cpu=step.seq_lens_cpu,
    )
