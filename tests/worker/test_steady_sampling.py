"""A steady decode batch reuses the last step's sampling metadata; anything that changes
the rows, or per-step state (penalties), builds it again. Outputs are the same either way."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.worker import sampling_inputs
from minivllm.worker.sampling_inputs import SamplingInputs

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 1, 2, 3, 5,"]


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    """The number of requests each built sampling metadata covered."""
    built = []
    build = sampling_inputs.build_sampling_metadata

    def counting(states, *args, **kwargs):
        built.append(len(states))
        return build(states, *args, **kwargs)

    monkeypatch.setattr(sampling_inputs, "build_sampling_metadata", counting)
    return built


def generate(model: str, sampling: list[SamplingParams]) -> list[list[int]]:
    llm = LLM(model, max_model_len=128, enable_multiprocessing=False)
    outputs = llm.generate(PROMPTS, sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def seeded(max_tokens: list[int], **kwargs) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=n, ignore_eos=True, **kwargs)
        for i, n in enumerate(max_tokens)
    ]


def test_a_steady_batch_builds_once_until_a_request_leaves(tiny_model, builds):
    generate(tiny_model, seeded([20, 20, 12]))
    # The prompts' step, then one build per change of the batch: the third request leaving.
    assert builds == [3, 2]


def test_reused_metadata_draws_the_same_tokens(tiny_model, builds, monkeypatch):
    sampling = seeded([20, 16, 12])
    reused = generate(tiny_model, sampling)
    assert len(builds) < 10
    uncached = SamplingInputs.metadata

    def fresh(self, *args):
        self.steady = None
        return uncached(self, *args)

    monkeypatch.setattr(SamplingInputs, "metadata", fresh)
    builds.clear()
    assert generate(tiny_model, sampling) == reused
    assert len(builds) == 20  # one a step


def test_penalties_build_every_step(tiny_model, builds):
    generate(tiny_model, seeded([10, 10, 10], repetition_penalty=1.2))
    assert builds == [3] * 10
