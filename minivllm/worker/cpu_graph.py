"""Decode steps replayed as a list of C kernel calls: graphs for the CPU, after CUDA graphs.

With a few sequences a decode step of a small model is ~3 ms of kernels and ~1.5 ms of the
model's Python around them (module calls, shape checks, wrappers), which llama.cpp does not
pay. On the CPU every op of a Llama or Gemma 3 decode step is a C kernel reached through
ctypes or a torch op that writes a given tensor, so a step can be captured once per batch
size: one forward runs with ``cpu_kernels.launch`` noting each call (function and
arguments: pointers into tensors that the graph keeps alive), while a dispatch mode checks
that torch itself only allocated, took views or wrote tensors in place or through ``out=``
(those ops are noted too). Later steps of that size copy their embeddings into the
graph's input and make the same calls, the kernels' from C (``run_calls``: one ctypes call
for a run of them instead of one each, ~3 us apiece); the block table, the sequence lengths
and the sliding windows' first positions, new each step, are passed again. A capture that saw
anything else (a GEMM of torch's, a collective) is dropped and the size runs eagerly, as it
does with ``enforce_eager``. A kept graph is checked once: its replay must give the
captured step's output bit for bit.

Where the runner samples, the LM head is captured too (``with_logits``): its product runs in
the same call to C as the layers', and the replay leaves every row's logits in the graph's
``logits``, without the Python of an eager LM head between the layers and the draw. A model
whose logits need an op the graph cannot replay (a scaling, a soft cap) keeps its graph of
the layers and computes them eagerly.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.kernels import cpu_kernels

logger = logging.getLogger(__name__)

# Batch sizes captured (decode steps of 1..MAX_BATCH sequences); each keeps its own
# intermediate tensors (~1 MB a sequence for a 135M model).
MAX_BATCH = 8

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default,
}


class _Watch(TorchDispatchMode):
    """Keeps what torch allocates during the capture, notes its in-place ops, and flags any
    other op that computes (it would not be replayed)."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls
        self.kept: list[torch.Tensor] = []
        self.refused: str | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise torch wraps __torch_dispatch__ in dynamo's disable, whose first call
        # imports torch._dynamo: 2.3 s in the first request's first decode step. Nothing
        # under this mode is compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.kept.append(out)
        elif func._schema.is_mutable:
            self.calls.append((functools.partial(func, **kwargs), args, None))
        elif not _is_view(func) and self.refused is None:
            self.refused = str(func)
        return out


def _is_view(func) -> bool:
    return any(
        a.alias_info is not None and not a.alias_info.is_write for a in func._schema.returns
    ) or func in (torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor)


class _KernelRun:
    """Consecutive kernel calls made in one call to C (``run_calls``): their slot twins'
    addresses and arguments in arrays, the step's inputs written into those at each replay."""

    def __init__(self, calls: list, run_calls) -> None:
        twins, starts, slots, dynamic = [], [], [], {}
        for function, args, step_inputs in calls:
            twins.append(function.slots)
            starts.append(len(slots))
            for index, name in (step_inputs or {}).items():
                dynamic.setdefault(name, []).append(len(slots) + index)
            slots += cpu_kernels.as_slots(function, args)
        self.twins = np.array(twins, dtype=np.int64)
        self.starts = np.array(starts, dtype=np.int64)
        self.slots = np.array(slots, dtype=np.int64)
        self.dynamic = [(name, np.array(at)) for name, at in dynamic.items()]
        self.run_calls = run_calls
        arrays = (self.twins, self.slots, self.starts)
        self.call = (len(twins), *(a.ctypes.data for a in arrays))

    def __call__(self, step: dict) -> None:
        for name, at in self.dynamic:
            self.slots[at] = step[name]
        self.run_calls(*self.call)


def _python_call(function, args, step_inputs):
    """A call made from Python (a torch op the capture noted, or a kernel with no slot
    twin), its step inputs passed anew."""

    def call(step: dict) -> None:
        if not step_inputs:
            function(*args)
            return
        filled = list(args)
        for index, name in step_inputs.items():
            filled[index] = step[name]
        function(*filled)

    return call


def _program(calls: list) -> list:
    """The step's calls as runs of kernels made from C and the calls between them (all
    from Python if the library that makes the runs is not built)."""
    lib = cpu_kernels.load_library()
    program, run = [], []
    for call in calls:
        if lib is not None and getattr(call[0], "slots", None) is not None:
            run.append(call)
            continue
        if run:
            program.append(_KernelRun(run, lib.run_calls))
            run = []
        program.append(_python_call(*call))
    if run:
        program.append(_KernelRun(run, lib.run_calls))
    return program


class CPUGraph:
    """One batch size's captured decode step."""

    def __init__(
        self,
        calls: list,
        inputs_embeds: torch.Tensor,
        output: torch.Tensor,
        kept,
        logits: torch.Tensor | None = None,
    ):
        self.program = _program(calls)
        # The sliding windows whose starts the step passes (Gemma 3's local layers).
        self.windows = sorted(
            {_step_input(n) for _, _, d in calls for n in (d or {}).values()} - {"step", None}
        )
        self.inputs_embeds = inputs_embeds
        self.output = output
        self.kept = kept  # the intermediate tensors the noted pointers point into
        # Every row's logits after a replay (the LM head captured: with_logits), else None.
        self.logits = logits

    @classmethod
    def capture(cls, model, embeds, positions, attn_metadata, before_check=None, with_logits=False):
        """Run the step's forward while noting its calls: (output, graph or None).
        before_check: called before the checking replay (a hybrid model's state cache puts
        back the states the forward advanced, so the replay advances them once again).
        with_logits: note the LM head's calls on every row too (``model.compute_logits``),
        where they can be replayed; the graph's ``logits`` then holds a replay's logits."""
        static = embeds.clone()
        calls: list = []
        refused, kept = _noted(calls, model, None, positions, attn_metadata, inputs_embeds=static)
        output = kept.pop()
        if refused is not None:
            logger.debug("No CPU graph for %d sequences: %s", embeds.shape[0], refused)
            return output, None
        logits = None
        if with_logits:
            head: list = []
            head_refused, head_kept = _noted(head, model.compute_logits, output)
            logits = head_kept.pop()
            if head_refused is None and logits is not None:
                calls += head
                kept += head_kept
            else:
                logits = None
        graph = cls(calls, static, output, kept, logits)
        expected = output.clone()
        expected_logits = logits.clone() if logits is not None else None
        if before_check is not None:
            before_check()
        replayed = graph.replay(embeds, attn_metadata)
        if not torch.equal(replayed, expected) or (
            logits is not None and not torch.equal(graph.logits, expected_logits)
        ):
            logger.warning("A replayed decode step differed from its capture: running eagerly.")
            return expected, None
        return expected, graph

    def replay(self, embeds: torch.Tensor, attn_metadata) -> torch.Tensor:
        """The step's hidden states (the graph's own output tensor: use it before the next
        replay)."""
        self.inputs_embeds.copy_(embeds)
        table = attn_metadata.single_block_table
        step = {
            "block_table": table.data_ptr(),
            "seq_lens": attn_metadata.single_seq_lens.data_ptr(),
            "max_blocks": table.shape[1],
        }
        for window in self.windows:  # the metadata keeps them alive through the step
            starts = attn_metadata.starts_for_window(window)
            step[f"window_starts:{window}"] = starts.data_ptr()
        for call in self.program:  # runs of kernels, and torch's in-place ops
            call(step)
        return self.output


def _noted(calls: list, function, *args, **kwargs) -> tuple[str | None, list]:
    """Call ``function`` while noting its kernel calls and torch's in-place ops into
    ``calls``: (why it cannot be replayed or None, the tensors torch allocated followed by
    its result)."""
    watch = _Watch(calls)
    cpu_kernels._recording = calls
    try:
        with watch:
            result = function(*args, **kwargs)
    finally:
        cpu_kernels._recording = None
    refused = watch.refused
    for _, _, dynamic in calls:
        unknown = {n for n in (dynamic or {}).values() if _step_input(n) is None}
        refused = refused or (f"step input {sorted(unknown)}" if unknown else None)
    return refused, [*watch.kept, result]


_STEP_INPUTS = {"block_table", "seq_lens", "max_blocks"}


def _step_input(name: str) -> str | int | None:
    """What a replay passes for a kernel argument so named: "step" for the step's block
    table, lengths and width, the window for a sliding window's starts, None: unknown."""
    if name in _STEP_INPUTS:
        return "step"
    kind, _, window = name.partition(":")
    return int(window) if kind == "window_starts" and window.isdigit() else None
