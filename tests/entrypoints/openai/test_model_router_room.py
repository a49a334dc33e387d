"""The router's room-making policy without engine processes (as the scheduler's tests run
without a model): which loaded model goes when another must load, within
--max-loaded-models and --models-memory, and what is refused. The engines are stand-ins
that only record their shutdown; test_many_models.py runs the same with real cores."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import pytest

from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.model_router import ModelRouter
from minivllm.entrypoints.openai.model_router_args import GIB, RouterConfig
from minivllm.entrypoints.openai.served_model import ModelBusyError, ModelStatus


class _Engine:
    """What the router asks of a loaded engine when it unloads it."""

    errored = False

    def __init__(self) -> None:
        self.stopped = False
        self.engine_core = SimpleNamespace(shutdown=self.stop)

    def stop(self) -> None:
        self.stopped = True

    def shutdown(self) -> None:
        self.stopped = True


def _router(**limits) -> ModelRouter:
    config = RouterConfig(
        catalog={"a": "/m/a.gguf", "b": "/m/b.gguf", "c": "/m/c.gguf"},
        load_timeout_s=0.3,
        **limits,
    )
    return ModelRouter(config, argparse.Namespace(kv_cache_memory_bytes=None))


def _loaded(router: ModelRouter, name: str, gib: float, last_used: float) -> _Engine:
    model = router.models[name]
    engine = _Engine()
    model.state = SimpleNamespace(engine=engine)
    model.status, model.last_used = ModelStatus.LOADED, last_used
    model.memory_bytes = model.reserved_bytes = int(gib * GIB)
    return engine


def test_the_least_recently_used_idle_model_makes_room():
    router = _router(memory_bytes=2 * GIB)
    a, b = _loaded(router, "a", 1, last_used=1.0), _loaded(router, "b", 1, last_used=2.0)
    c = router.models["c"]
    asyncio.run(router._make_room(c, GIB))
    assert a.stopped and not b.stopped
    assert router.models["a"].status is ModelStatus.UNLOADED
    assert c.reserved_bytes == GIB


def test_a_busy_model_is_passed_over_for_an_idle_one():
    router = _router(memory_bytes=2 * GIB)
    a, b = _loaded(router, "a", 1, last_used=1.0), _loaded(router, "b", 1, last_used=2.0)
    router.models["a"].in_flight = 1
    asyncio.run(router._make_room(router.models["c"], GIB))
    assert b.stopped and not a.stopped


def test_the_model_count_limit_unloads_too():
    router = _router(max_loaded_models=2)
    a, b = _loaded(router, "a", 1, last_used=5.0), _loaded(router, "b", 1, last_used=2.0)
    asyncio.run(router._make_room(router.models["c"], 100 * GIB))  # no memory limit
    assert b.stopped and not a.stopped


def test_enough_room_unloads_nothing():
    router = _router(memory_bytes=3 * GIB, max_loaded_models=3)
    a, b = _loaded(router, "a", 1, last_used=1.0), _loaded(router, "b", 1, last_used=2.0)
    asyncio.run(router._make_room(router.models["c"], GIB))
    assert not a.stopped and not b.stopped


def test_busy_models_leave_no_room_past_the_timeout():
    router = _router(memory_bytes=2 * GIB)
    for name in ("a", "b"):
        _loaded(router, name, 1, last_used=1.0)
        router.models[name].in_flight = 1
    with pytest.raises(ModelBusyError, match="stay busy") as error:
        asyncio.run(router._make_room(router.models["c"], GIB))
    assert error.value.retry_after >= 1


def test_a_model_larger_than_the_budget_is_refused_with_the_numbers():
    router = _router(memory_bytes=2 * GIB)
    a = _loaded(router, "a", 1, last_used=1.0)
    with pytest.raises(BadRequestError, match=r"`c` needs about 3.00 GiB .* 2.00 GiB"):
        asyncio.run(router._make_room(router.models["c"], 3 * GIB))
    assert not a.stopped  # nothing unloaded for a model that can never fit
