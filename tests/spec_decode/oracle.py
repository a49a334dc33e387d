"""A proposer that knows the answer: random weights seldom repeat themselves, so tests of
the engine's proposal mechanics propose the plain engine's own next tokens instead."""

from __future__ import annotations

from minivllm.spec_decode import ngram_proposer


def install(monkeypatch, answers: list[list[int]]) -> None:
    """Proposals are the continuation of the answer (prompt + output) the tokens so far
    begin, the last proposed token wrong every other time (the model's own replaces it)."""
    calls = []

    def knowing(self, token_ids, max_tokens=None):
        tokens = token_ids.tolist()
        (answer,) = [a for a in answers if a[: len(tokens)] == tokens]
        proposal = answer[len(tokens) : len(tokens) + min(self.k, max_tokens or self.k)]
        calls.append(1)
        if proposal and len(calls) % 2:
            proposal[-1] += 1
        return proposal

    monkeypatch.setattr(ngram_proposer.NgramProposer, "propose", knowing)
