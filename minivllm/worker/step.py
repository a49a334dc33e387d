"""The runner's step and the hooks its features enter it through.

``ModelRunner._execute_model`` is the step itself::

    update states      the scheduler's diffs: requests added, removed, moved (InputBatch)
    update_states      hooks: in a step where requests arrive or leave
    prepare            hooks: before the step's inputs are built
    build inputs       InputBatch.prepare, the attention metadata
    before_forward     hooks: the step's inputs (``step.inputs``) built
    forward            eager, fast prefill, a CUDA graph or a CPU graph (ModelRunner._forward)
    after_forward      hooks: the hidden states in hand; a hook may end the step (its output)
    sample             logits of the sampling rows, the sampler, the ids to every TP rank
    after_sample       hooks: the sampled ids on the host, before the requests take them
    output             the requests take their tokens; the step's ModelRunnerOutput
    after_output       hooks: the output built; a hook may add to it

A feature is a ``StepFeature`` that overrides the hooks it needs; it lives in its own
module under ``worker/`` and keeps its own state between steps (and between the hooks of
one step). Features talk to the step, and to each other, through the ``RunnerStep`` every
hook receives: a feature earlier in the runner's list may set a field that a later one
reads (``reads_all_rows`` before speculative decoding's layout); a feature that needs
another's state is handed it when made (``ModelRunner._features``). Today's features:

- ``prompt_logprobs.PromptLogprobs``: update_states, prepare, after_forward;
- ``lora_step.LoRAStep``: prepare (the step's adapters; a graph variant or eager);
- ``spec_decode_step.SpecDecode``: prepare (proposals in the inputs), after_sample
  (verification), after_output (the next proposals);
- ``pooling_step.PoolingStep``: after_forward (ends the step with the embeddings);
- ``state_cache_step.StateCacheStep``: before_forward (a hybrid model's state slots);
- ``async_scheduling.AsyncScheduling``: update_states (a preempted request's draw
  undone), prepare (the tokens in flight), and the step's return path (``launch``: the
  output is collected later, after_sample and after_output with it).

A new feature: a ``StepFeature`` in its own module, listed in ``ModelRunner._features``
(or added once the worker has what it needs, as ``ModelRunner.set_state_cache`` does),
with the ``RunnerStep`` fields it sets given their defaults here.

Structured outputs' bitmasks enter the sampling metadata (``sampling_inputs.py``); the
tensor-parallel broadcast of the sampled ids is part of sampling itself.

Cost: the runner calls only the hooks a feature overrides (``StepHooks``, built once), so
a hook no feature uses costs nothing, and a step creates one ``RunnerStep``. A hook runs
on every step of every request: keep it O(batch) numpy or a few Python operations, and
return at once when the step holds nothing of its feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.sample.bans import RequestBans
from minivllm.sample.penalties import SeenTokens
from minivllm.sampling_params import SamplingParams
from minivllm.worker.pooler import PoolingState

if TYPE_CHECKING:
    from minivllm.lora.request import LoRARequest
    from minivllm.worker.cuda_graph import GraphOutput
    from minivllm.worker.step_inputs import InFlightTokens, StepInputs


@dataclass
class CachedRequestState:
    """What the runner remembers of a request beyond its InputBatch row: what the sampler
    and the logprobs need as Python objects (it sees a request once)."""

    req_id: str
    # The tokens it came with: its prompt (and a resumed request's outputs before it was
    # preempted). The tokens sampled since are in output_ids (and the InputBatch's row).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    # (ids, logprobs, ranks) of the prompt tokens so far, when the request asks for them.
    prompt_logprobs: tuple[list, list, list] | None = None
    seen_tokens: SeenTokens | None = None  # for penalties; built when first needed
    bans: RequestBans | None = None  # bad words, logit bias, allowed tokens; built when needed
    pooling: PoolingState | None = None  # a pooling request's chunks so far
    lora_request: LoRARequest | None = None
    state_slot: int | None = None  # a hybrid model's state cache slot


class RunnerStep:
    """One step as its hooks see it: what the scheduler asked, what the features decided,
    and what the step has computed so far. Made once a step; every field a hook may set
    has its default here."""

    __slots__ = (
        "so",
        "req_ids",
        "num_scheduled",
        "in_flight",
        "num_drafts",
        "drafts_as_decode_rows",
        "reads_all_rows",
        "eager",
        "graph_variant",
        "draw_states",
        "inputs",
        "hidden",
        "graph_output",
        "states",
        "sampling_rows",
        "token_ids",
        "token_lists",
        "last_rows",
        "prompt_logprobs",
        "output",
    )

    def __init__(self, so: SchedulerOutput) -> None:
        self.so = so
        self.req_ids: list[str] = list(so.num_scheduled_tokens)  # the scheduler's order
        self.num_scheduled: list[int] = list(so.num_scheduled_tokens.values())
        # prepare: how the inputs are built.
        self.in_flight: InFlightTokens | None = None  # async: the last step's, on the device
        self.num_drafts: np.ndarray | None = None  # spec decode: proposals per request
        self.drafts_as_decode_rows = False  # spec decode: proposals as one-token rows
        # Some request reads the outputs of all its rows (prompt logprobs): no fast
        # prefill, no proposals as decode rows.
        self.reads_all_rows = False
        # prepare: how the forward runs. eager: neither graph nor fast prefill (several
        # adapters); graph_variant: besides the batch size, what tells this step's CPU graph
        # apart (an adapter's slot); a step with one takes no CUDA graph and no fast prefill.
        self.eager = False
        self.graph_variant: Any = None
        self.draw_states: dict[str, torch.Tensor] = {}  # async: generators before the draw
        # Built by the step.
        self.inputs: StepInputs | None = None
        self.hidden: torch.Tensor | None = None
        # The step's CUDA graph replay (its hidden states, and the logits and their argmax
        # where the graph holds the LM head); None: no graph ran it.
        self.graph_output: GraphOutput | None = None
        self.states: list[CachedRequestState] = []  # the requests that sample, in order
        self.sampling_rows: np.ndarray | None = None  # their InputBatch rows
        # after_sample: the sampled ids (one per logits row) on the host; token_lists, if a
        # hook sets it, the tokens each sampling request keeps (else its one id), and
        # last_rows each one's row in the logprobs' tensors.
        self.token_ids: list[int] = []
        self.token_lists: list[list[int]] | None = None
        self.last_rows: list[int] | None = None
        # after_forward: req_id -> finished prompt logprobs, for the output.
        self.prompt_logprobs: dict[str, tuple] = {}
        # A hook that sets it ends the step with this output (pooling).
        self.output: ModelRunnerOutput | None = None


class StepFeature:
    """A feature of the runner's step: override the hooks it needs (see the module's
    docstring for where each runs). The base class's hooks are never called."""

    def update_states(self, so: SchedulerOutput) -> None:
        """Requests arrived (``so.scheduled_new_reqs``, their runner state made) or left
        (``so.finished_req_ids``; ``so.preempted_req_ids`` of them come back later as new);
        not called in a step where neither happened (a steady decode)."""

    def prepare(self, step: RunnerStep) -> None:
        """Before the step's inputs are built (the step schedules some tokens)."""

    def before_forward(self, step: RunnerStep) -> None:
        """``step.inputs`` and the attention metadata are built; the forward is next."""

    def after_forward(self, step: RunnerStep) -> None:
        """``step.inputs`` and ``step.hidden`` are set; the InputBatch has not advanced."""

    def after_sample(self, step: RunnerStep) -> None:
        """``step.token_ids`` on the host, before the requests take them. A hook may set
        ``step.token_lists`` (and ``last_rows``) in a synchronous step only: with async
        scheduling each request takes its one id (the two features do not combine)."""

    def after_output(self, step: RunnerStep, output: ModelRunnerOutput) -> None:
        """The step's output, its tokens taken by the requests and the InputBatch."""


_HOOKS = (
    "update_states",
    "prepare",
    "before_forward",
    "after_forward",
    "after_sample",
    "after_output",
)


class StepHooks:
    """Each hook's bound methods, of the features that override it, in the features'
    order: the step loops over a tuple, empty when no feature uses the hook."""

    def __init__(self, features: list[StepFeature]) -> None:
        self.features = features
        for hook in _HOOKS:
            base = getattr(StepFeature, hook)
            calls = tuple(getattr(f, hook) for f in features if getattr(type(f), hook) is not base)
            setattr(self, hook, calls)

    def of_type(self, cls: type) -> Any:
        """The feature of this class, or None."""
        return next((f for f in self.features if isinstance(f, cls)), None)
