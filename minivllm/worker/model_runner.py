"""The one bridge between scheduler bookkeeping and tensors: batch in, sampled ids out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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
from minivllm.distributed.parallel_state import TPGroup
from minivllm.engine.profiler import profile_range
from minivllm.platforms import get_platform
from minivllm.sample.bans import RequestBans
from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.penalties import SeenTokens
from minivllm.sample.sampler import Sampler, SamplingMetadata, gather_logprobs
from minivllm.sample.structured import grammar_rows
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker import cpu_graph
from minivllm.worker.cpu_graph import CPUGraph
from minivllm.worker.cuda_graph import CudaGraphRunner, capture_sizes
from minivllm.worker.input_batch import InFlightTokens, InputBatch, StepInputs
from minivllm.worker.pooler import Pooler, PoolingState

if TYPE_CHECKING:
    from minivllm.config import SpeculativeConfig
    from minivllm.lora.model_manager import LoRAModelManager
    from minivllm.lora.request import LoRARequest
    from minivllm.model.layers.state_cache import StateCache

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """What the runner remembers of a request beyond its InputBatch row: what the sampler
    and the logprobs need as Python objects (it sees a request once)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    # (ids, logprobs, ranks) of the prompt tokens so far, when the request asks for them.
    prompt_logprobs: tuple[list, list, list] | None = None
    prompt_logprobs_sent: bool = False
    seen_tokens: SeenTokens | None = None  # for penalties; built when first needed
    bans: RequestBans | None = None  # bad words, logit bias, allowed tokens; built when needed
    pooling: PoolingState | None = None  # a pooling request's chunks so far
    lora_request: LoRARequest | None = None
    state_slot: int | None = None  # a hybrid model's state cache slot


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
    ) -> None:
        """pooler: the pooling runner's (every request is pooled, none sampled).
        lora_manager: the adapters' (enable_lora): a step with any runs eagerly (_forward).
        speculative_config: proposals, checked by the next step (``_propose``)."""
        self.model = model
        self.pooler = pooler
        self.lora_manager = lora_manager
        self.device = torch.device(device)
        self.platform = get_platform(self.device.type)
        self.attn_backend = attn_backend
        # Decode steps replayed as kernel calls (cpu_graph.py), by batch size; None: that
        # size runs eagerly.
        self.cpu_graphs: dict[int, CPUGraph | None] | None = None
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
        # Only for a model whose later layers read earlier ones' K/V (see _fast_prefill).
        self.kv_sharing_fast_prefill = (
            kv_sharing_fast_prefill and getattr(model, "shares_kv_cache", False) and pooler is None
        )
        # Decode steps replayed as CUDA graphs (``capture_model``, on a GPU); None: eager.
        self.cuda_graphs: CudaGraphRunner | None = None
        self.input_batch = InputBatch(
            sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens, block_size, self.device
        )
        self.requests: dict[str, CachedRequestState] = {}
        # Requests whose prompt logprobs are still being collected.
        self.prompt_logprob_reqs: set[str] = set()
        # Seeded generators outlive preemption, so a resumed request keeps its random stream.
        self.generators: dict[str, torch.Generator] = {}
        # Async scheduling: execute_model returns before the sampled ids reach the host
        # (an AsyncModelRunnerOutput), and the next step takes them as inputs on the device.
        self.async_scheduling = sc.async_scheduling and pooler is None and self.tp.size == 1
        self.in_flight: InFlightTokens | None = None  # the last step's, until collected
        # ((batch version, sampling rows), metadata on the device) of a steady batch.
        self._steady_sampling: tuple[tuple, SamplingMetadata] | None = None
        self.state_cache: StateCache | None = None  # a hybrid model's (set_state_cache)
        self.proposer = None
        if speculative_config is not None and pooler is None:
            self.proposer = NgramProposer(
                speculative_config.num_speculative_tokens,
                speculative_config.prompt_lookup_min,
                speculative_config.prompt_lookup_max,
            )

    def set_state_cache(self, state_cache: StateCache) -> None:
        """A hybrid model's state cache: each step tells it the requests' slots. A state
        cannot take back a rejected proposal's tokens: no speculative decoding with it."""
        if self.proposer is not None:
            raise ValueError("Speculative decoding does not support models with state layers.")
        self.state_cache = state_cache

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprob_reqs.discard(req_id)
            batch.remove_request(req_id)
            if req_id in so.preempted_req_ids:
                self._undo_draw(req_id)
            else:
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
        batch.condense()
        cached = so.scheduled_cached_reqs
        batch.update_cached(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)

    def _undo_draw(self, req_id: str) -> None:
        """A request preempted while its token is in flight: the scheduler drops that
        token, and the request computes it again once resumed. Its generator goes back to
        before the draw, so that the token is drawn from the same number as in a
        synchronous engine, where it would have been kept."""
        state = self.in_flight.draw_states.get(req_id) if self.in_flight else None
        if state is not None:
            self.generators[req_id].set_state(state)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        if seed is not None and new.req_id not in self.generators:
            # On the device the draws happen: a seeded row's numbers never leave it.
            generator = torch.Generator(device=self.device)
            self.generators[new.req_id] = generator.manual_seed(seed)
        wants_prompt_logprobs = new.sampling_params.prompt_logprobs is not None
        if wants_prompt_logprobs:
            self.prompt_logprob_reqs.add(new.req_id)
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
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        batch = self.input_batch
        drafts = so.scheduled_spec_decode_tokens
        num_drafts = None
        if drafts:
            batch.set_drafts(drafts)
            num_drafts = np.fromiter(
                (len(drafts.get(r, ())) for r in req_ids), np.int64, len(req_ids)
            )
        with profile_range("prepare_inputs"):
            # Proposals as decode rows, unless a request's prompt logprobs read its rows.
            decode_rows = bool(drafts) and not self.prompt_logprob_reqs.intersection(req_ids)
            step = batch.prepare(
                req_ids,
                list(so.num_scheduled_tokens.values()),
                self.in_flight,
                num_drafts,
                decode_rows,
            )
            if step.in_flight_all:  # the last step's draws, still on the device
                step.input_ids.copy_(self.in_flight.sampled)
            elif step.in_flight_inputs is not None:  # some of them
                dst, src = step.in_flight_inputs
                step.input_ids[dst] = self.in_flight.sampled[src]
            attn_metadata = self.attn_backend.build_metadata(common_metadata(step))
            if self.state_cache is not None:
                slots = [self.requests[r].state_slot for r in req_ids]
                self.state_cache.begin_runner_step(slots, step)
            prompt_logprob_rows = self._prompt_logprob_rows(step)
            if self.lora_manager is not None:
                loras = [self.requests[r].lora_request for r in req_ids]
                self.lora_manager.set_batch(loras, list(so.num_scheduled_tokens.values()))
        with profile_range("forward"):
            hidden = self._forward(step, attn_metadata, prompt_logprob_rows)
        if self.pooler is not None:
            with profile_range("pool"):
                pooled = self._pool(step, hidden)
            batch.advance(step)
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled)
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_logprob_rows)
        batch.advance(step)
        if not len(step.sampling):
            return ModelRunnerOutput(
                req_ids, [[] for _ in req_ids], prompt_logprobs=prompt_logprobs
            )
        sampling_rows = step.rows[step.sampling]
        states = [self.requests[req_ids[i]] for i in step.sampling.tolist()]
        # A logits row per sampling request; with proposals, one per proposed token too.
        row_states, rows = states, sampling_rows
        if step.num_logits is not None:
            counts = step.num_logits.tolist()
            row_states = [s for s, n in zip(states, counts) for _ in range(n)]
            rows = np.repeat(sampling_rows, step.num_logits)
        with profile_range("compute_logits"):
            logits = self.model.compute_logits(hidden[step.logits_indices])
        draw_states = {}
        if self.async_scheduling:  # the draws a preemption may have to undo (_undo_draw)
            seeded = (s for s in states if s.generator is not None)
            draw_states = {s.req_id: s.generator.get_state() for s in seeded}
        if logits is not None:
            with profile_range("sample"):
                out = self.sampler(logits, self._sampling_metadata(so, row_states, rows))
            sampled_ids = out.sampled_token_ids
        else:  # a tensor-parallel rank other than 0: rank 0's draw arrives below
            out = None
            sampled_ids = torch.empty(len(row_states), dtype=torch.long, device=self.device)
        sampled_ids = self.tp.broadcast_from_first(sampled_ids)
        with_logprobs = out is not None and out.logprobs is not None
        tensors = [sampled_ids]
        if with_logprobs:
            tensors += [out.logprob_token_ids, out.logprobs, out.sampled_ranks]

        def output(token_ids: list[int], host: list[torch.Tensor]) -> ModelRunnerOutput:
            token_lists = [[t] for t in token_ids]
            return self._sampled_output(req_ids, states, token_lists, host[1:], prompt_logprobs)

        if not self.async_scheduling:
            # The step's one wait for the device: the sampled ids (and logprobs, if asked).
            host = self._to_host(tensors)
            if step.num_logits is None:
                batch.append_tokens(sampling_rows, host[0].numpy())
                result = output(host[0].tolist(), host)
            else:
                token_lists, last_rows = accept_drafts(
                    host[0].tolist(), counts, [drafts.get(s.req_id) for s in states]
                )
                batch.append_token_lists(sampling_rows, token_lists)
                result = self._sampled_output(
                    req_ids, states, token_lists, host[1:], prompt_logprobs, last_rows
                )
            if self.proposer is not None and self.tp.is_first:
                result.spec_token_ids = self._propose(states)
            return result
        # Async: the ids travel to the host behind this step's work; the next step is
        # launched before anyone waits for them.
        positions = batch.append_placeholders(sampling_rows)
        req_ids_sampled = [s.req_id for s in states]
        in_flight = InFlightTokens(req_ids_sampled, positions, sampled_ids, draw_states)
        self.in_flight = in_flight
        host = tensors
        if not self.platform.host_is_device:
            host = [t.to("cpu", non_blocking=True) for t in tensors]
        copied = self.platform.record_event()

        def collect() -> ModelRunnerOutput:
            if copied is not None:
                copied.synchronize()  # this step's copies only, not the steps after it
            if self.in_flight is in_flight:
                self.in_flight = None  # the host has them: a later step reads them there
            token_ids = host[0].tolist()
            batch.set_tokens(in_flight.req_ids, positions, token_ids)
            return output(token_ids, host)

        return AsyncModelRunnerOutput(collect)

    def _sampling_metadata(
        self, so: SchedulerOutput, states: list[CachedRequestState], rows: np.ndarray
    ) -> SamplingMetadata:
        """The step's sampling metadata, on the device. A steady decode batch (the same rows
        sample, none with state that changes per step: penalties, bans, a grammar) takes the
        last step's again: no per-row gathers, no host-to-device copies."""
        key = (self.input_batch.version, rows.tobytes())
        if self._steady_sampling is not None and self._steady_sampling[0] == key:
            return self._steady_sampling[1]
        arrays = self.input_batch.sampling.gather(rows)
        metadata = build_sampling_metadata(states, self.vocab_size, arrays)
        metadata.grammar = grammar_rows(so, [s.req_id for s in states])
        metadata = metadata.to(self.device)
        steady = metadata.grammar is None and not (
            arrays.uses_penalties.any() or arrays.has_bans_or_biases.any()
        )
        self._steady_sampling = (key, metadata) if steady else None
        return metadata

    def _sampled_output(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        token_lists: list[list[int]],
        logprob_tensors: list[torch.Tensor],
        prompt_logprobs: dict[str, tuple],
        logprob_rows: list[int] | None = None,
    ) -> ModelRunnerOutput:
        """The step's output from the sampled ids (and the logprobs' tensors, if asked) on
        the host; each state takes its tokens. logprob_rows: each state's row in the
        logprobs' tensors (with proposals; else the state's index)."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, tuple] = {}
        with_logprobs = bool(logprob_tensors)
        if with_logprobs:
            lp_ids, lp_values, ranks = (t.tolist() for t in logprob_tensors)
        for i, (state, tokens) in enumerate(zip(states, token_lists)):
            state.token_ids.extend(tokens)
            state.output_ids.extend(tokens)
            sampled[state.req_id] = tokens
            k = state.sampling_params.logprobs
            if with_logprobs and k is not None:  # such a request is never given proposals
                k = self.vocab_size if k == -1 else k
                j = i if logprob_rows is None else logprob_rows[i]
                logprobs[state.req_id] = (lp_ids[j][: 1 + k], lp_values[j][: 1 + k], ranks[j])
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=[logprobs.get(r) for r in req_ids] if logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Proposed next tokens of the requests that sampled, where their sampling allows:
        nothing read from their own outputs on the host (penalties would have to count the
        proposals), no logprobs.

        A proposal is kept when the token sampled at its row is the proposal itself. For a
        greedy request that is the argmax; for a random one, each row draws from its own
        distribution, so a proposal is kept with exactly its probability and, when it is
        not, the token drawn there is distributed as the rest of that distribution: the
        rejection sampling of speculative decoding for a proposer that is certain of its
        proposal (vLLM's, for n-gram drafts). Outputs follow the model's distribution; a
        seeded request's, drawing more numbers a step, differ from its plain ones."""
        proposals = {}
        batch = self.input_batch
        for state in states:
            params = state.sampling_params
            if (
                params.reads_own_outputs
                or params.logprobs is not None
                or state.req_id in self.prompt_logprob_reqs
            ):
                continue
            left = (params.max_tokens or 1 << 62) - len(state.output_ids) - 1
            row = batch.req_id_to_row[state.req_id]
            tokens = self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]], left)
            if tokens:
                proposals[state.req_id] = tokens
        return proposals

    def _pool(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Give each request's rows to its pooling; the embeddings of those whose prompt
        this step finished (the rows that would sample), on tensor-parallel rank 0."""
        if self.pooler.reads_every_chunk:
            starts = step.query_start_loc_cpu.tolist()
            for i, req_id in enumerate(step.req_ids):
                first_position = int(step.positions_cpu[starts[i]])
                rows = hidden[starts[i] : starts[i + 1]]
                self.pooler.add_chunk(self.requests[req_id].pooling, rows, first_position)
        if not len(step.sampling) or not self.tp.is_first:
            return {}
        done = [step.req_ids[i] for i in step.sampling.tolist()]
        states = [self.requests[req_id].pooling for req_id in done]
        return dict(zip(done, self.pooler.pool(states, hidden[step.logits_indices])))

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
        )
        self.cuda_graphs.capture()

    def _forward(self, step: StepInputs, attn_metadata, prompt_logprob_rows=()) -> torch.Tensor:
        batch = step.num_attn_rows  # requests, or tokens when proposals go as decode rows
        graph_key = batch  # the CPU graph of a step: by batch size, and adapter slot if any
        groups = self.lora_manager.batch.groups if self.lora_manager is not None else None
        if groups:
            # Adapters in this step: CUDA graphs are captured without them, and the fast
            # prefill drops rows that the adapters' row mapping counts. A CPU graph captured
            # with one adapter's slot serves the steps whose rows all take that slot.
            if len(groups) > 1 or groups[0][1] is not None:
                return self.model(step.input_ids, step.positions, attn_metadata)
            graph_key = (batch, groups[0][0])
        elif (
            step.max_query_len > 1
            and self.kv_sharing_fast_prefill
            and not prompt_logprob_rows
            and step.num_logits is None  # proposals' rows are read too: a step of them all
        ):
            fast = self._fast_prefill(step)
            return self.model(step.input_ids, step.positions, attn_metadata, fast_prefill=fast)
        if self.cuda_graphs is not None and not groups:
            hidden = self.cuda_graphs.run(step)
            if hidden is not None:
                return hidden
        graphs = self.cpu_graphs
        if (
            graphs is None
            or step.max_query_len != 1
            or batch > cpu_graph.MAX_BATCH
            or (graph_key in graphs and graphs[graph_key] is None)  # this one runs eagerly
        ):
            return self.model(step.input_ids, step.positions, attn_metadata)
        embeds = self.model.embed_input_ids(step.input_ids)
        if graph_key not in graphs:
            restore = self.state_cache.checkpoint() if self.state_cache is not None else None
            hidden, graphs[graph_key] = CPUGraph.capture(
                self.model, embeds, step.positions, attn_metadata, restore
            )
            return hidden
        return graphs[graph_key].replay(embeds, attn_metadata)

    def _to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors on the host, after one wait for the device (none on the CPU)."""
        if self.platform.host_is_device:
            return tensors
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        self.platform.synchronize()
        return host

    def _fast_prefill(self, step: StepInputs) -> tuple[torch.Tensor, object]:
        """(rows, metadata) for the layers that read earlier layers' K/V: the rows whose
        logits are sampled (the last of each request that samples) and the attention
        metadata of those rows alone, a decode step's (one query each, at the end of its
        context); no other row's output is read, and those layers write no K/V of their
        own. vLLM's kv_sharing_fast_prefill."""
        count = len(step.sampling)
        if count == 0:
            return step.logits_indices, None
        requests = torch.from_numpy(step.sampling)
        query_start_loc = torch.arange(count + 1, dtype=torch.int32)
        seq_lens_cpu = step.seq_lens_cpu[requests]
        on_device = requests.to(self.device)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=step.seq_lens[on_device],
            block_table=step.block_table[on_device],
            slot_mapping=step.slot_mapping[step.logits_indices],
            num_actual_tokens=count,
            max_query_len=1,
            max_seq_len=int(seq_lens_cpu.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_cpu,
        )
        return step.logits_indices, self.attn_backend.build_metadata(common)

    def _prompt_logprob_rows(
        self, step: StepInputs
    ) -> list[tuple[CachedRequestState, list[int], list[int]]]:
        """(state, batch rows, target token ids) of the requests collecting prompt logprobs:
        position p predicts prompt token p + 1."""
        if not self.prompt_logprob_reqs:
            return []
        found = []
        starts = step.query_start_loc_cpu.tolist()
        for i, req_id in enumerate(step.req_ids):
            if req_id not in self.prompt_logprob_reqs:
                continue
            state = self.requests[req_id]
            start = int(step.positions_cpu[starts[i]])  # tokens computed before this step
            end = start + int(step.num_scheduled[i])
            last = min(end, state.num_prompt_tokens - 1)
            first = max(start, len(state.prompt_logprobs[2]))
            rows = list(range(starts[i] + first - start, starts[i] + last - start))
            targets = state.token_ids[first + 1 : last + 1]
            found.append((state, rows, targets))
        return found

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        prompt_logprob_rows: list[tuple[CachedRequestState, list[int], list[int]]],
    ) -> dict[str, tuple]:
        """Logprobs of each prompt token given what precedes it, for requests that ask.

        A prompt computed in chunks collects them chunk by chunk; the whole list is sent
        once the prompt is done: (ids [P-1][1+k], logprobs [P-1][1+k], ranks [P-1]).
        """
        finished = {}
        for state, rows, targets in prompt_logprob_rows:
            k = state.sampling_params.prompt_logprobs
            k = self.vocab_size if k == -1 else k
            if rows:
                logits = self.model.compute_logits(hidden[rows])
                if logits is None:  # not rank 0: only the count matters here
                    state.prompt_logprobs[2].extend([0] * len(rows))
                else:
                    logprobs = torch.log_softmax(logits, dim=-1)
                    targets = torch.tensor(targets, device=logprobs.device)
                    ids, values, ranks = gather_logprobs(logprobs, targets, k)
                    state.prompt_logprobs[0].extend(ids.tolist())
                    state.prompt_logprobs[1].extend(values.tolist())
                    state.prompt_logprobs[2].extend(ranks.tolist())
            if len(state.prompt_logprobs[2]) == state.num_prompt_tokens - 1:
                finished[state.req_id] = tuple(state.prompt_logprobs)
                state.prompt_logprobs_sent = True
                self.prompt_logprob_reqs.discard(state.req_id)
        return finished


def accept_drafts(
    sampled: list[int], counts: list[int], drafts: list[list[int] | None]
) -> tuple[list[list[int]], list[int]]:
    """Verification: each request's sampled ids at its proposals and after them (counts[i]
    of them) keep the proposals up to the first the sampled token differs from, then the
    sampled token there (see ``_propose``). Returns the kept tokens and each request's row
    of its last kept token."""
    token_lists, last_rows = [], []
    start = 0
    for n, proposed in zip(counts, drafts):
        targets = sampled[start : start + n]
        kept = 0
        while kept < n - 1 and targets[kept] == proposed[kept]:
            kept += 1
        token_lists.append(targets[: kept + 1])
        last_rows.append(start + kept)
        start += n
    return token_lists, last_rows


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
