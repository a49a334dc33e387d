"""A many-model server reads each local model's config and builds its tokenizer before it
takes requests (ModelRouter.prepare): a tokenizer built at a model's first start would hold
the GIL while the loaded models serve. Hub names wait for their first start; a model that
cannot be read is left to it."""

from __future__ import annotations

import argparse
import asyncio

from minivllm.entrypoints.openai.cli_args import make_arg_parser
from minivllm.entrypoints.openai.model_router import ModelRouter
from minivllm.entrypoints.openai.model_router_args import router_config_from


def _router(tmp_path, smollm2_path: str) -> ModelRouter:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["--model", f"small={smollm2_path}", "--model", f"broken={broken}",
         "--model", "hub=org/never-downloaded", "--max-model-len", "512"]
    )  # fmt: skip
    return ModelRouter(router_config_from(args), args)


def test_prepare_builds_local_models_tokenizers_and_configs(tmp_path, smollm2_path):
    router = _router(tmp_path, smollm2_path)
    asyncio.run(router.prepare())
    small = router.models["small"]
    assert small.tokenizer is not None and small.tokenizer.encode("hello")
    assert small.model_config.max_model_len == 512
    for name in ("broken", "hub"):  # left to their first start, which says why
        assert router.models[name].tokenizer is None
        assert router.models[name].model_config is None
    assert {m.status.value for m in router.models.values()} == {"unloaded"}
