"""Faults injected through one request (tests only), as a bug in per-request code would be.

A marker in a request's parameters makes its grammar matcher (in the engine core) or its
detokenizer (in the frontend) raise a few tokens in; every other request is untouched.
`install()` patches this process; `sitecustomize_dir()` makes a folder whose
sitecustomize.py installs the faults in every Python process started with it on PYTHONPATH
(a server and its spawned engine core).
"""

from __future__ import annotations

import os
import tempfile

# Structured outputs with these regexes fail while filling the bitmask, or while advancing
# the grammar, at their FAULT_AT-th token.
FILL_FAULT_REGEX = r"fill-fault [a-z ]{40}"
ACCEPT_FAULT_REGEX = r"accept-fault [a-z ]{40}"
# A request with this stop string fails in the frontend's detokenizer.
DETOKENIZER_FAULT_STOP = "<detokenizer-fault>"
FAULT_AT = 3


class InjectedFault(RuntimeError):
    pass


class _Countdown:
    def __init__(self) -> None:
        self.calls = 0

    def tick(self, where: str) -> None:
        self.calls += 1
        if self.calls == FAULT_AT:
            raise InjectedFault(f"injected fault in {where}")


class FaultyMatcher:
    """A real xgrammar matcher that raises at the FAULT_AT-th call of one of its methods."""

    def __init__(self, matcher, method: str) -> None:
        self._matcher = matcher
        self._method = method
        self._countdown = _Countdown()

    def __getattr__(self, name):
        return getattr(self._matcher, name)

    def fill_next_token_bitmask(self, *args):
        if self._method == "fill":
            self._countdown.tick("fill_next_token_bitmask")
        return self._matcher.fill_next_token_bitmask(*args)

    def accept_token(self, token_id: int) -> bool:
        if self._method == "accept":
            self._countdown.tick("accept_token")
        return self._matcher.accept_token(token_id)


def install(setattr_=setattr) -> None:
    """Patch the matcher's start and the detokenizer (setattr_: monkeypatch.setattr in tests)."""
    from minivllm.engine.detokenizer import IncrementalDetokenizer
    from minivllm.structured_output.request import StructuredOutputRequest

    faulty_methods = {FILL_FAULT_REGEX: "fill", ACCEPT_FAULT_REGEX: "accept"}
    is_ready = StructuredOutputRequest.is_ready

    def faulty_is_ready(self, make_matcher) -> bool:
        ready = is_ready(self, make_matcher)
        method = faulty_methods.get(self.params.regex)
        if ready and method and not isinstance(self.matcher, FaultyMatcher):
            self.matcher = FaultyMatcher(self.matcher, method)
        return ready

    update = IncrementalDetokenizer.update

    def faulty_update(self, new_token_ids, num_output_tokens):
        if DETOKENIZER_FAULT_STOP in (self.params.stop or []):
            countdown = self.__dict__.setdefault("_fault_countdown", _Countdown())
            countdown.tick("IncrementalDetokenizer.update")
        return update(self, new_token_ids, num_output_tokens)

    setattr_(StructuredOutputRequest, "is_ready", faulty_is_ready)
    setattr_(IncrementalDetokenizer, "update", faulty_update)


def sitecustomize_dir() -> str:
    """A folder to put first on PYTHONPATH (with the repository root after it)."""
    folder = tempfile.mkdtemp(prefix="minivllm-faults-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write("from tests.faults import install\n\ninstall()\n")
    return folder
