"""SLOParams: a request's latency class and targets, read by the `slo` scheduling policy.

vLLM has no such fields. A latency-sensitive request (an interactive chat) asks for its
tokens at a pace: `tpot` seconds per output token after the first (the seed's "slo"), and
optionally its first token within `ttft` seconds of arrival. A best-effort request (the
default: batch work, evaluations) only needs throughput and takes what the targets leave.
A target left None takes the server's default (--default-slo-tpot / --default-slo-ttft);
with no default either, a latency-sensitive request is only served first.
"""

from __future__ import annotations

import math
from numbers import Real

import msgspec


class SLOParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """A msgspec struct: it rides in SamplingParams across the process boundary."""

    is_latency_sensitive: bool = False
    tpot: float | None = None  # seconds per output token after the first
    ttft: float | None = None  # seconds from arrival to the first token

    def __post_init__(self) -> None:
        if not isinstance(self.is_latency_sensitive, bool):
            raise ValueError(
                f"is_latency_sensitive must be a boolean, got {self.is_latency_sensitive!r}."
            )
        for name in ("tpot", "ttft"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"The SLO's {name} must be a number of seconds, got {value!r}.")
            if value <= 0:
                raise ValueError(f"The SLO's {name} must be positive, got {value}.")
        if not self.is_latency_sensitive and (self.tpot is not None or self.ttft is not None):
            raise ValueError(
                "An SLO target (slo, slo_ttft) was given for a best-effort request: set "
                "is_latency_sensitive to true for the scheduler to meet it."
            )

    def with_defaults(self, tpot: float | None, ttft: float | None) -> SLOParams:
        """The targets, the server's defaults filling those the request left unset (a
        best-effort request has none)."""
        if not self.is_latency_sensitive:
            return self
        return SLOParams(
            True,
            self.tpot if self.tpot is not None else tpot,
            self.ttft if self.ttft is not None else ttft,
        )


BEST_EFFORT = SLOParams()


def parse_bool(value: object, name: str) -> bool:
    """A JSON boolean, or the strings "True"/"False" (any case) that seed 003's client sends."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f'`{name}` must be a boolean (or "True"/"False"), got {value!r}.')


# The request-body fields every API takes (seed 003's names).
SLO_FIELDS = ("is_latency_sensitive", "slo", "slo_ttft")


def slo_params_from_fields(
    is_latency_sensitive: object = None, slo: object = None, slo_ttft: object = None
) -> SLOParams | None:
    """SLOParams from a request body's fields; None for a plain best-effort request.
    is_latency_sensitive unset: latency-sensitive when a target is given."""
    if is_latency_sensitive is None:
        sensitive = slo is not None or slo_ttft is not None
    else:
        sensitive = parse_bool(is_latency_sensitive, "is_latency_sensitive")
    if not sensitive and slo is None and slo_ttft is None:
        return None
    return SLOParams(sensitive, slo, slo_ttft)
