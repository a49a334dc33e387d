"""Beam search in the frontend, one token per round over all live beams (as vLLM does).

Each round asks the engine for one token per beam with 2 * beam_width logprobs; beams
share their prefix through the prefix cache, so a round costs one decode per beam.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from minivllm.logprobs import PositionLogprobs
from minivllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included), its logprobs and its score."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """Cumulative logprob divided by length ** length_penalty (a final EOS not counted)."""
    length = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)


_ids = itertools.count()


def run_beam_search(engine, prompts: list[list[int]], params: BeamSearchParams):
    """Beam search for each prompt (token ids) on an LLMEngine; one BeamSearchOutput each."""
    eos = engine.processor.eos_token_id
    width = params.beam_width
    step_params = SamplingParams(
        logprobs=2 * width, max_tokens=1, temperature=params.temperature, detokenize=False
    )
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        requests = {}  # request id -> (prompt index, beam)
        for i, beams in enumerate(live):
            for beam in beams:
                request_id = f"beam-{next(_ids)}"
                engine.add_request(request_id, {"prompt_token_ids": beam.tokens}, step_params)
                requests[request_id] = (i, beam)
        if not requests:
            break
        results = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                results[output.request_id] = output.outputs[0].logprobs[0]
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for request_id, (i, beam) in requests.items():
            position = results[request_id]
            for token_id, logprob in position.items():
                candidates[i].append(
                    BeamSearchSequence(
                        beam.tokens + [token_id],
                        beam.logprobs + [position],
                        beam.cum_logprob + logprob.logprob,
                    )
                )
        for i, found in enumerate(candidates):
            found.sort(key=lambda b: b.cum_logprob, reverse=True)
            next_beams = []
            for rank, beam in enumerate(found[: 2 * width]):
                if beam.tokens[-1] == eos and not params.ignore_eos:
                    if rank < width:  # only an EOS among the best `width` ends a hypothesis
                        beam.finish_reason = "stop"
                        done[i].append(beam)
                elif len(next_beams) < width:
                    next_beams.append(beam)
            live[i] = next_beams

    tokenizer = engine.get_tokenizer()
    outputs = []
    for live_beams, done_beams in zip(live, done):
        for beam in live_beams:
            beam.finish_reason = "length"
        best = sorted(done_beams + live_beams, key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
        outputs.append(BeamSearchOutput(best))
    return outputs
