"""The runner's step calls its features' hooks in the documented order (step.py), and only
the hooks a feature overrides."""

from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.worker.step import RunnerStep, StepFeature, StepHooks


class Recorder(StepFeature):
    """Every hook it sees, with what the step holds at that point."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def update_states(self, so) -> None:
        new = sorted(r.req_id for r in so.scheduled_new_reqs)
        self.calls.append(("update_states", new, sorted(so.finished_req_ids)))

    def prepare(self, step: RunnerStep) -> None:
        self.calls.append(("prepare", step.inputs is None))

    def before_forward(self, step: RunnerStep) -> None:
        self.calls.append(("before_forward", step.inputs is not None and step.hidden is None))

    def after_forward(self, step: RunnerStep) -> None:
        self.calls.append(("after_forward", step.hidden is not None))

    def after_sample(self, step: RunnerStep) -> None:
        self.calls.append(("after_sample", len(step.token_ids)))

    def after_output(self, step: RunnerStep, output) -> None:
        self.calls.append(("after_output", [len(t) for t in output.sampled_token_ids]))


class OnlyPrepare(StepFeature):
    def prepare(self, step: RunnerStep) -> None:
        pass


def test_only_the_hooks_a_feature_overrides_are_called():
    first, second = OnlyPrepare(), OnlyPrepare()
    hooks = StepHooks([first, second])
    assert hooks.prepare == (first.prepare, second.prepare)  # in the features' order
    for name in ("update_states", "before_forward", "after_forward", "after_sample"):
        assert getattr(hooks, name) == ()
    assert hooks.after_output == () and hooks.of_type(OnlyPrepare) is first


def record(model: str, **kwargs) -> list[tuple]:
    llm = LLM(model, max_model_len=64, enable_multiprocessing=False, **kwargs)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    recorder = Recorder()
    runner.hooks = StepHooks([*runner.hooks.features, recorder])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(["Hello, my name is"], params, use_tqdm=False)
    return recorder.calls


STEP = [
    ("prepare", True),
    ("before_forward", True),
    ("after_forward", True),
    ("after_sample", 1),
    ("after_output", [1]),
]


def test_a_feature_sees_every_step_in_order(tiny_opt):
    calls = record(tiny_opt)
    # The request arrives in the first step; then steady decode steps (no update_states).
    assert calls == [("update_states", ["0"], []), *STEP, *STEP, *STEP]


def test_with_async_scheduling_a_steps_output_hooks_run_when_it_is_collected(tiny_opt):
    calls = record(tiny_opt, async_scheduling=True)
    names = [call[0] for call in calls]
    assert calls[0] == ("update_states", ["0"], [])
    for hook in ("prepare", "before_forward", "after_forward", "after_sample", "after_output"):
        assert names.count(hook) == 3, hook
    # The next step is launched before the last one's ids are collected.
    assert names.index("after_sample") > names.index("prepare", 2)
    assert [c for c in calls if c[0] in ("after_sample", "after_output")] == STEP[3:] * 3
