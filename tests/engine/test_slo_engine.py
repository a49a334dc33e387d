"""The slo scheduling policy in a real engine (a tiny random-weight Llama): the start-up
calibration fits the step-time model, hopeless latency-sensitive requests are refused by
the frontend, and greedy outputs under random arrivals are FCFS's, token for token."""

from __future__ import annotations

import random
import time

import pytest

from minivllm import EngineArgs, SamplingParams
from minivllm.core import slo_policy
from minivllm.core.step_time_model import StepShape
from minivllm.engine.llm_engine import LLMEngine
from minivllm.slo_params import SLOParams


def make_engine(model: str, policy: str) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            scheduling_policy=policy,
            default_slo_tpot=0.1,
            enable_multiprocessing=False,
            seed=0,
        )
    )


def run_random_arrivals(engine: LLMEngine, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    tokens: dict[str, list[int]] = {}
    pending = []
    for i in range(14):
        prompt = [rng.randint(10, 2000) for _ in range(rng.randint(3, 90))]
        slo = SLOParams(True) if rng.random() < 0.4 else None
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True, slo_params=slo
        )
        pending.append((rng.randint(0, 30), f"r{i}", prompt, params))
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            engine.add_request(item[1], {"prompt_token_ids": item[2]}, item[3])
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    return tokens


@pytest.mark.slow
def test_greedy_outputs_under_random_arrivals_are_fcfs_ones(tiny_llama):
    results = {}
    for policy in ("fcfs", "slo"):
        engine = make_engine(tiny_llama, policy)
        if policy == "slo":
            # A slow machine as the policy sees it (4 ms a token, kept): best-effort prompts
            # are cut into chunks beside the latency-sensitive decodes, in other batches.
            model = engine.engine_core.engine_core.scheduler.policy.model
            model.load([0.0, 0.0, 0.004, 0.004, 0.0])
            model.refit_every = 1 << 30
            engine.processor.slo_admission.model.load(model.coefficients)
        try:
            results[policy] = run_random_arrivals(engine)
        finally:
            engine.shutdown()
    assert len(results["fcfs"]) == 14
    assert results["slo"] == results["fcfs"]


def test_calibration_fits_the_model_and_the_frontend_refuses_hopeless_targets(tiny_llama):
    engine = make_engine(tiny_llama, "slo")
    try:
        core = engine.engine_core.engine_core
        model = core.scheduler.policy.model
        assert model.fitted and model.num_observations >= 5
        assert engine.engine_core.step_time_model == [float(c) for c in model.coefficients]
        assert not core.scheduler.requests  # the calibration's requests are gone
        hopeless = SamplingParams(max_tokens=4, slo_params=SLOParams(True, tpot=1e-7))
        with pytest.raises(ValueError, match="cannot meet its TPOT target"):
            engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, hopeless)
        fine = SamplingParams(max_tokens=4, slo_params=SLOParams(True, tpot=10.0))
        engine.add_request("y", {"prompt_token_ids": [5, 6, 7]}, fine)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()


def test_the_frontends_admission_follows_the_cores_refitted_model(tiny_llama):
    engine = make_engine(tiny_llama, "slo")
    try:
        admission = engine.processor.slo_admission
        # A calibration taken on a busy machine: 10 s a step, so every chat looks hopeless.
        admission.model.load([10.0, 0.0, 0.0, 0.0, 0.0])
        chat = SamplingParams(max_tokens=4, slo_params=SLOParams(True, tpot=1.0))
        with pytest.raises(ValueError, match="cannot meet its TPOT target"):
            engine.add_request("early", {"prompt_token_ids": [5, 6, 7]}, chat)
        # Any steps bring the core's own model back with their scheduler stats.
        engine.add_request("job", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        core_model = engine.engine_core.engine_core.scheduler.policy.model
        assert list(admission.model.coefficients) == [float(c) for c in core_model.coefficients]
        engine.add_request("later", {"prompt_token_ids": [5, 6, 7]}, chat)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()


def test_a_pessimistic_model_with_no_steps_to_correct_it_does_not_refuse_for_good(
    tiny_llama, monkeypatch
):
    """A calibration on a busy machine (10 s a step) and only latency-sensitive requests
    after it: each is refused and no step runs, so nothing could refit the model. Once no
    step has confirmed it for STALE_MODEL_S, a request runs, and its steps refit it."""
    monkeypatch.setattr(slo_policy, "STALE_MODEL_S", 0.5)
    engine = make_engine(tiny_llama, "slo")
    try:
        core_model = engine.engine_core.engine_core.scheduler.policy.model
        for model in (core_model, engine.processor.slo_admission.model):
            model.load([10.0, 0.0, 0.0, 0.0, 0.0])
        chat = SamplingParams(max_tokens=8, ignore_eos=True, slo_params=SLOParams(True, tpot=1.0))
        with pytest.raises(ValueError, match="cannot meet its TPOT target"):
            engine.add_request("refused", {"prompt_token_ids": [5, 6, 7]}, chat)
        time.sleep(0.6)
        engine.add_request("runs", {"prompt_token_ids": [5, 6, 7]}, chat)
        while engine.has_unfinished_requests():
            engine.step()
        assert core_model.predict(StepShape().with_request(1, 10)) < 1.0  # refitted
        engine.add_request("admitted", {"prompt_token_ids": [5, 6, 7]}, chat)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
