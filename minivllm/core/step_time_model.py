"""How long an engine step takes, predicted from its shape and fitted online from measured steps.

A step's time is modelled as linear in five features of its shape:

    t = c0 + c_mixed * [has prompt tokens] + c_prompt * prompt tokens
           + c_decode * decode rows + c_attn * attention work

where a decode row is a request with one new token (it samples, and on a CPU its row runs
the matrix-vector kernels, dearer per token than a prompt chunk's matrix-matrix ones),
prompt tokens are those of requests with several, and attention work sums, over the
step's requests, the (query, key) pairs its new tokens meet: n * (context + (n + 1) / 2)
for n new tokens after `context` computed ones. c0 is the step's fixed cost (the weights
read once, launch overhead); c_mixed what a step with prompt rows adds to it (on the CPU,
decode-only steps replay recorded kernel calls; steps with prompts run eagerly); attention
grows with context. The coefficients are fitted by
least squares on the relative error (each step weighted by 1/t^2, so short decode steps
count as much as long prefills), with exponential forgetting so that the model follows the
machine, and kept non-negative (a step never gets cheaper by adding work).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from minivllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

NUM_FEATURES = 5
# Attention work is counted in thousands of (query, key) pairs, to keep the features'
# scales near each other.
_ATTN_SCALE = 1e-3


def attention_work(num_new: int, num_computed: int) -> float:
    """(query, key) pairs of num_new tokens after num_computed ones, in thousands."""
    return num_new * (num_computed + (num_new + 1) / 2) * _ATTN_SCALE


@dataclass
class StepShape:
    """What a step computes, as the model sees it; built up request by request."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_decode_rows: int = 0
    attn_work: float = 0.0

    def add(self, num_new: int, num_computed: int, sign: int = 1) -> None:
        self.num_tokens += sign * num_new
        self.num_seqs += sign
        self.num_decode_rows += sign * (num_new == 1)
        self.attn_work += sign * attention_work(num_new, num_computed)

    def remove(self, num_new: int, num_computed: int) -> None:
        self.add(num_new, num_computed, -1)

    def copy(self) -> StepShape:
        return StepShape(self.num_tokens, self.num_seqs, self.num_decode_rows, self.attn_work)

    def with_request(self, num_new: int, num_computed: int) -> StepShape:
        shape = self.copy()
        shape.add(num_new, num_computed)
        return shape

    def merged(self, other: StepShape) -> StepShape:
        return StepShape(
            self.num_tokens + other.num_tokens,
            self.num_seqs + other.num_seqs,
            self.num_decode_rows + other.num_decode_rows,
            self.attn_work + other.attn_work,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens - self.num_decode_rows

    def features(self) -> np.ndarray:
        prompt = self.num_prompt_tokens
        return np.array([1.0, float(prompt > 0), prompt, self.num_decode_rows, self.attn_work])

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepShape:
        """The shape of a scheduled step: each request's tokens after its computed ones
        (as the step found them)."""
        computed = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        shape = cls()
        for req_id, n in output.num_scheduled_tokens.items():
            shape.add(n, computed.get(req_id, 0))
        return shape


class StepTimeModel:
    """Online least squares over step shapes; predict() in seconds."""

    def __init__(
        self,
        forgetting: float = 0.995,
        refit_every: int = 4,
        error_window: int = 1000,
        log_interval_s: float = 60.0,
    ) -> None:
        self.forgetting = forgetting
        self.refit_every = refit_every
        # Weighted normal equations, decayed by `forgetting` per observation.
        self._xtx = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._xty = np.zeros(NUM_FEATURES)
        self._yty = 0.0
        self.coefficients = np.zeros(NUM_FEATURES)
        self.num_observations = 0
        # Relative errors of the predictions made before each step's time was known.
        self.errors: deque[float] = deque(maxlen=error_window)
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()

    @property
    def fitted(self) -> bool:
        return self.num_observations >= NUM_FEATURES

    def predict(self, shape: StepShape) -> float:
        return float(self.coefficients @ shape.features())

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record a measured step: its error under the current fit, then refit."""
        if seconds <= 0 or shape.num_tokens <= 0:
            return
        if self.fitted:
            self.errors.append(abs(self.predict(shape) - seconds) / seconds)
        x = shape.features()
        w = 1.0 / (seconds * seconds)  # relative error
        f = self.forgetting
        self._xtx = f * self._xtx + w * np.outer(x, x)
        self._xty = f * self._xty + w * seconds * x
        self._yty = f * self._yty + w * seconds * seconds
        self.num_observations += 1
        if self.num_observations % self.refit_every == 0 or not self.fitted:
            self.coefficients = self._solve()
        self._maybe_log()

    def median_error(self) -> float | None:
        """Median relative error of the recent predictions (None before any)."""
        return statistics.median(self.errors) if self.errors else None

    def load(self, coefficients: list[float]) -> None:
        """Start from known coefficients (a frontend's copy of the core's calibration)."""
        self.coefficients = np.asarray(coefficients, dtype=float)
        self.num_observations = max(self.num_observations, NUM_FEATURES)

    def _solve(self) -> np.ndarray:
        """Non-negative least squares over five features: the best of the solutions on each
        subset of features whose coefficients all come out non-negative."""
        ridge = 1e-9 * (np.trace(self._xtx) + 1e-12)
        best, best_residual = np.zeros(NUM_FEATURES), self._yty
        for k in range(1, NUM_FEATURES + 1):
            for subset in itertools.combinations(range(NUM_FEATURES), k):
                idx = list(subset)
                a = self._xtx[np.ix_(idx, idx)] + ridge * np.eye(k)
                try:
                    beta = np.linalg.solve(a, self._xty[idx])
                except np.linalg.LinAlgError:
                    continue
                if (beta < 0).any():
                    continue
                residual = self._yty - 2 * beta @ self._xty[idx] + beta @ a @ beta
                if residual < best_residual:
                    best = np.zeros(NUM_FEATURES)
                    best[idx] = beta
                    best_residual = residual
        return best

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s or not self.errors:
            return
        self._last_log = now
        self.log_error()

    def log_error(self) -> None:
        error = self.median_error()
        if error is None:
            return
        c = self.coefficients
        logger.info(
            "SLO step-time model: median error %.1f%% over the last %d steps (%.2f ms per "
            "step + %.2f ms with prompts + %.3f ms per prompt token + %.3f ms per decode row "
            "+ %.4f ms per 1k attention pairs)",
            100 * error,
            len(self.errors),
            *(1e3 * c),
        )
