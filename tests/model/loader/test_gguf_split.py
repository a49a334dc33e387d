"""A split GGUF (``NAME-00001-of-0000N.gguf``, written here by the ``gguf`` package's own
splitting writer from the bundled model) is one model: the first part's metadata, every
part's tensors, the same greedy outputs as the file it was split from, also when a Hub
GGUF repo's chosen quantization is the split one."""

from __future__ import annotations

import os

import pytest
import torch

from minivllm.model.loader import iter_weights, load_hf_config, read_gguf_header
from tests.model.sources.fake_hub import FakeHub
from tests.model.sources.test_hub import resolve

PARTS = 3


def write_split_gguf(source: str, folder: str, stem: str, max_tensors: int) -> list[str]:
    """``source`` rewritten by gguf's GGUFWriter in parts of at most ``max_tensors`` tensors
    (the metadata in the first, the ``split.*`` keys in each, as llama.cpp's gguf-split)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(
        os.path.join(folder, f"{stem}.gguf"), arch, split_max_tensors=max_tensors
    )
    copy_with_new_metadata(reader, writer, {}, [])
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(stem))


@pytest.fixture(scope="module")
def split_parts(tmp_path_factory, smollm2_path) -> list[str]:
    count = len(read_gguf_header(smollm2_path).tensor_shapes)
    folder = str(tmp_path_factory.mktemp("split"))
    parts = write_split_gguf(smollm2_path, folder, "SmolLM2-Q4_1", -(-count // PARTS))
    assert [os.path.basename(p) for p in parts] == [
        f"SmolLM2-Q4_1-{k:05d}-of-{PARTS:05d}.gguf" for k in range(1, PARTS + 1)
    ]
    return parts


def test_a_split_file_reads_as_the_file_it_was_split_from(split_parts, smollm2_path):
    whole, split = read_gguf_header(smollm2_path), read_gguf_header(split_parts[0])
    assert split.tensor_shapes == whole.tensor_shapes
    assert set(split.metadata) - {"split.no", "split.count", "split.tensors.count"} == set(
        whole.metadata
    )
    assert {split.file_of(name) for name in split.tensor_shapes} == set(split_parts)
    configs = [load_hf_config(p).to_dict() for p in (split_parts[0], smollm2_path)]
    for config in configs:
        config.pop("_name_or_path", None)
    assert configs[0] == configs[1]
    # Every tensor, from whichever part holds it: the same blocks (kept quantized) or values.
    pairs = zip(
        iter_weights(split_parts[0], torch.float32, "gguf"),
        iter_weights(smollm2_path, torch.float32, "gguf"),
        strict=True,
    )
    for (name, got), (expected_name, want) in pairs:
        assert name == expected_name
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
        else:
            assert got.qtype == want.qtype and torch.equal(got.raw, want.raw), name


def test_a_later_part_or_a_missing_part_is_refused_in_words(split_parts, tmp_path):
    with pytest.raises(ValueError, match=f"part 2 of {PARTS} of a split GGUF: pass its first"):
        read_gguf_header(split_parts[1])
    for part in split_parts[:-1]:  # the last part missing
        os.symlink(part, tmp_path / os.path.basename(part))
    first = str(tmp_path / os.path.basename(split_parts[0]))
    with pytest.raises(FileNotFoundError, match=f"misses part {PARTS} of {PARTS}"):
        read_gguf_header(first)
    renamed = str(tmp_path / "renamed.gguf")
    os.symlink(split_parts[0], renamed)
    with pytest.raises(ValueError, match="not named as one"):
        read_gguf_header(renamed)


def greedy(model: str) -> list[list[int]]:
    from minivllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=256, enable_multiprocessing=False)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    del llm
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_hub_repo_whose_quantization_is_split_serves_it_as_one_model(
    split_parts, smollm2_path, tmp_path
):
    hub = FakeHub()
    hub.add_repo(
        "org/SmolLM2-GGUF",
        {os.path.basename(p): p for p in split_parts}
        | {"SmolLM2-Q8_0.gguf": smollm2_path},  # another quantization beside it
    )
    hub.start()
    try:
        path, error = resolve(hub, tmp_path / "cache", "org/SmolLM2-GGUF:Q4_1")
    finally:
        hub.stop()
    assert error is None and path.endswith(f"SmolLM2-Q4_1-00001-of-{PARTS:05d}.gguf")
    assert greedy(path) == greedy(smollm2_path)
