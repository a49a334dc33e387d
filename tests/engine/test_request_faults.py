"""A failure inside a step that one request caused fails that request alone (finish_reason
"error"); the other requests of the same step finish with their normal greedy outputs, and
the engine serves the next request. (A failure of the whole step kills the engine:
test_engine_faults.py.)"""

from __future__ import annotations

import time

import msgspec
import pytest

from minivllm import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams
from tests import faults

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3,"]
MAX_TOKENS = 12


def free_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def faulty_params(kind: str) -> SamplingParams:
    if kind == "detokenizer":
        stop = [faults.DETOKENIZER_FAULT_STOP]
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stop)
    regex = faults.FILL_FAULT_REGEX if kind == "fill" else faults.ACCEPT_FAULT_REGEX
    return SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )


def constrained_params() -> SamplingParams:  # a healthy grammar beside the faulty one
    return SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{5}-[a-z ]{20}"),
    )


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_llama, max_model_len=512, enable_multiprocessing=False)
    )
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add all, step until done: {request id: (final output, index of its last step)}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished, step = {}, 0
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        outputs = engine.step()  # empty while a grammar compiles
        for output in outputs:
            if output.finished:
                finished[output.request_id] = (output, step)
        step += bool(outputs)
        assert time.monotonic() < deadline
    return finished


def assert_idle(engine: LLMEngine) -> None:
    scheduler = engine.engine_core.engine_core.scheduler
    scheduler.check_invariants()
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.kv_cache_usage == 0.0
    assert not engine.output_processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["fill", "accept", "detokenizer"])
def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch, kind):
    others = {f"free{i}": (p, free_params()) for i, p in enumerate(PROMPTS)}
    others["constrained"] = (PROMPTS[0], constrained_params())
    solo = {}
    for request_id, request in others.items():
        solo[request_id] = run(engine, {request_id: request})[request_id][0].outputs[0]
    assert len(solo["free0"].token_ids) == MAX_TOKENS
    # Without the fault the same request is fine (and its grammar is now compiled, so that
    # it starts in the same step as the others below).
    healthy = run(engine, {"warm": (PROMPTS[1], faulty_params(kind))})["warm"][0]
    assert healthy.outputs[0].finish_reason in ("stop", "length")

    faults.install(monkeypatch.setattr)
    finished = run(engine, {**others, "bad": (PROMPTS[1], faulty_params(kind))})

    bad, bad_step = finished.pop("bad")
    assert bad.outputs[0].finish_reason == "error"
    assert set(finished) == set(others)
    for request_id, (output, step) in finished.items():
        completion = output.outputs[0]
        assert step > bad_step, "the others were still running when the fault hit"
        assert completion.finish_reason == solo[request_id].finish_reason != "error"
        assert completion.token_ids == solo[request_id].token_ids, request_id
        assert completion.text == solo[request_id].text
    assert_idle(engine)

    # The engine serves the next request, the faulty kind included (failing alone again).
    again = run(engine, {"next": others["free2"], "bad2": (PROMPTS[2], faulty_params(kind))})
    assert again["next"][0].outputs[0].token_ids == solo["free2"].token_ids
    assert again["bad2"][0].outputs[0].finish_reason == "error"
    assert_idle(engine)


def test_a_request_the_core_cannot_add_fails_alone(engine, monkeypatch):
    """A failure while the core takes a request in (here: its constraint) ends it alone."""
    from minivllm.structured_output.manager import StructuredOutputManager

    new_request = StructuredOutputManager.new_request

    def failing_new_request(self, params):
        if params.regex == faults.FILL_FAULT_REGEX:
            raise faults.InjectedFault("injected fault in new_request")
        return new_request(self, params)

    monkeypatch.setattr(StructuredOutputManager, "new_request", failing_new_request)
    requests = {"ok": (PROMPTS[0], free_params()), "bad": (PROMPTS[1], faulty_params("fill"))}
    finished = run(engine, requests)
    assert finished["bad"][0].outputs[0].finish_reason == "error"
    assert finished["ok"][0].outputs[0].finish_reason == "length"
    assert len(finished["ok"][0].outputs[0].token_ids) == MAX_TOKENS
    assert_idle(engine)


def test_a_request_the_client_cannot_send_leaves_nothing_behind(engine, monkeypatch):
    """A failure sending a request to the core (an encoder's error, say) raises from
    add_request and leaves no request followed: the next ones run (before, the failed one
    stayed unfinished and stepping waited for it forever)."""
    core = engine.engine_core
    add = core.add_request

    def failing_add(request):
        if request.request_id.startswith("unsendable"):
            raise faults.InjectedFault("injected fault sending the request")
        return add(request)

    monkeypatch.setattr(core, "add_request", failing_add)
    with pytest.raises(faults.InjectedFault):
        engine.add_request("unsendable", PROMPTS[0], free_params())
    assert not engine.has_unfinished_requests()
    finished = run(engine, {"next": (PROMPTS[1], free_params())})
    assert len(finished["next"][0].outputs[0].token_ids) == MAX_TOKENS
    assert_idle(engine)


def test_a_request_the_core_cannot_decode_fails_alone(tiny_llama):
    """A request that reaches the engine core process with a field of the wrong type (here
    one a caller built and checked itself, as the server's EngineCoreRequest path allows)
    fails alone; before, the core's decoder raised and the engine died for every request."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_llama, max_model_len=512, enable_multiprocessing=True)
    )
    try:
        _, checked = engine.processor.process_inputs("bad", PROMPTS[1], free_params())
        unfit = msgspec.structs.replace(checked, priority="high")
        engine.add_request("bad", unfit, free_params())
        finished = run(engine, {"ok": (PROMPTS[0], free_params())})
        assert finished["bad"][0].outputs[0].finish_reason == "error"
        assert len(finished["ok"][0].outputs[0].token_ids) == MAX_TOKENS
        again = run(engine, {"next": (PROMPTS[0], free_params())})
        assert again["next"][0].outputs[0].token_ids == finished["ok"][0].outputs[0].token_ids
        assert not engine.output_processor.has_unfinished_requests()
    finally:
        engine.shutdown()
