"""minivllm.utils.remote_errors: an exception from another process raised again here."""

from __future__ import annotations

import pickle
import traceback

from minivllm.utils.remote_errors import RemoteTraceback, pickle_exception, rebuild_exception


def _raised(exc: BaseException) -> tuple[BaseException, str]:
    try:
        raise exc
    except BaseException as caught:
        return caught, traceback.format_exc()


def test_a_picklable_error_keeps_its_type_and_gets_the_remote_traceback():
    exc, tb = _raised(KeyError("missing"))
    rebuilt = rebuild_exception(pickle_exception(exc), "fallback", tb, where="worker rank 2")
    assert type(rebuilt) is KeyError and rebuilt.args == ("missing",)
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert str(rebuilt.__cause__).startswith("\n\nTraceback in worker rank 2:\n")
    assert "raise exc" in str(rebuilt.__cause__)
    # The traceback travels further (it pickles too).
    again = pickle.loads(pickle.dumps(rebuilt.__cause__))
    assert str(again) == str(rebuilt.__cause__)


def test_an_error_that_does_not_unpickle_comes_back_as_text():
    class NeedsTwo(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    exc, tb = _raised(NeedsTwo(1, 2))
    assert pickle_exception(exc) is None
    rebuilt = rebuild_exception(None, "NeedsTwo: 1/2", tb, where="the engine core process")
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "NeedsTwo: 1/2"
    assert "the engine core process" in str(rebuilt.__cause__)


def test_no_traceback_no_cause():
    assert rebuild_exception(None, "x", "", where="w").__cause__ is None
