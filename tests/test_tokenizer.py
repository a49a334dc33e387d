import json
import os

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from minivllm.model.loader import default_model_path
from minivllm.tokenizer import end_of_generation_ids, load_tokenizer, render_message_markers

TEXTS = [
    "Hello, my name is",
    " leading space,  double  spaces\n\nand newlines\t",
    "<|im_start|>user\nHi there<|im_end|>",
    "naïve café, 東京, emoji 🙂",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> str:
    folder = str(tmp_path / "cache")
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", folder)
    return folder


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def reference(gguf_path: str):
    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _gguf_loads(monkeypatch) -> list[str]:
    """Record every from_pretrained call that converts a GGUF."""
    calls: list[str] = []
    original = PreTrainedTokenizerFast.from_pretrained

    def recording(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return original(*args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", recording)
    return calls


def _check_matches(tok, reference) -> None:
    assert tok.is_fast
    for text in TEXTS:
        assert tok(text).input_ids == reference(text).input_ids, text
    assert tok("Hello, my name is").input_ids == [19556, 28, 957, 1462, 314]
    assert tok.chat_template and tok.chat_template == reference.chat_template
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    )
    assert len(tok) == len(reference)


def _check_gguf_special_tokens(tok) -> None:
    # SmolLM2's GGUF metadata: bos <|im_start|> = 1, eos <|im_end|> = 2. (transformers 5.17
    # reads eos as 1 from it, 5.23 as 2; load_tokenizer follows the metadata.)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_gguf_tokenizer_is_cached(gguf_path: str, reference, cache_dir: str, monkeypatch) -> None:
    calls = _gguf_loads(monkeypatch)

    first = load_tokenizer(gguf_path)
    assert len(calls) == 1
    _check_matches(first, reference)
    _check_gguf_special_tokens(first)
    assert any(files for _, _, files in os.walk(cache_dir)), "nothing was cached"

    second = load_tokenizer(gguf_path)
    assert len(calls) == 1, "second load converted the GGUF again instead of using the cache"
    _check_matches(second, reference)
    _check_gguf_special_tokens(second)


def test_directory_tokenizer(tmp_path, reference) -> None:
    folder = tmp_path / "model"
    reference.save_pretrained(folder)
    tok = load_tokenizer(str(folder))
    _check_matches(tok, reference)
    # A directory's special tokens are its own.
    assert (tok.bos_token_id, tok.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


def test_missing_path_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))


def test_end_of_generation_ids(tmp_path, gguf_path: str, reference) -> None:
    # A GGUF: its special end-of-turn tokens besides eos (SmolLM2's <|endoftext|>, id 0; its
    # eos is <|im_end|>), as llama.cpp stops on them.
    tok = load_tokenizer(gguf_path)
    assert tok.eos_token_id == 2
    assert end_of_generation_ids(gguf_path, tok, len(tok)) == [0]
    # A directory: the eos ids of its generation_config.json besides the tokenizer's.
    folder = tmp_path / "model"
    reference.save_pretrained(folder)
    tok = load_tokenizer(str(folder))
    assert end_of_generation_ids(str(folder), tok, len(tok)) == []
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9, 7]}))
    assert end_of_generation_ids(str(folder), tok, len(tok)) == [7, 9]
    assert end_of_generation_ids(str(folder), tok, 8) == [7]  # ids past the vocabulary: none
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert end_of_generation_ids(str(folder), tok, len(tok)) == []
    # A GGUF with a tokenizer directory: that directory's generation config counts too.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert end_of_generation_ids(gguf_path, tok, len(tok)) == [0, 9]


def test_harmony_vocabularies_do_not_stop_at_the_end_of_a_message(gguf_path: str) -> None:
    """Phi-3's <|end|> ends a turn; gpt-oss's ends each message (its reasoning too) and
    <|return|> or <|call|> the turn: with those two, <|end|> is no stop (as llama.cpp)."""
    tok = load_tokenizer(gguf_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    end = tok.convert_tokens_to_ids("<|end|>")
    assert end_of_generation_ids(gguf_path, tok, len(tok)) == [0, end]
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|return|>", "<|call|>"]})
    ret, call = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert end_of_generation_ids(gguf_path, tok, len(tok)) == [0, ret, call]


HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
GEMMA4 = [
    "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
    "<|tool_response>", "<tool_response|>", '<|"|>',
]  # fmt: skip


def test_gemma4_gguf_stops_at_the_end_of_a_turn_and_at_a_tools_answer(gguf_path: str) -> None:
    """<turn|> ends Gemma 4's turn and <|tool_response> waits for a tool's answer (both in
    llama.cpp's end-of-generation list), though the latter is rendered, not special."""
    tok = load_tokenizer(gguf_path)
    tok.add_special_tokens({"additional_special_tokens": GEMMA4})
    tok = render_message_markers(tok)
    turn_end, tool_response = tok.convert_tokens_to_ids(["<turn|>", "<|tool_response>"])
    assert "<|tool_response>" not in tok.all_special_tokens
    assert end_of_generation_ids(gguf_path, tok, len(tok)) == [0, turn_end, tool_response]


def test_harmony_markers_are_rendered(tmp_path, reference) -> None:
    """gpt-oss's message markers stay in decoded text (as llama.cpp renders them), so that
    its reasoning parser can split a reply; its turn ends are skipped as special tokens.
    A vocabulary without <|return|> and <|call|> keeps its <|end|> special (Phi-3's)."""
    from transformers import AutoTokenizer

    reference.save_pretrained(tmp_path / "base")

    def folder_with(specials: list[str], name: str) -> str:
        tok = AutoTokenizer.from_pretrained(tmp_path / "base")
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    tok = load_tokenizer(folder_with(HARMONY, "harmony"))
    reply = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
    ids = tok.encode(reply + "<|message|>4<|return|>")
    assert tok.decode(ids, skip_special_tokens=True) == reply + "<|message|>4"
    assert "<|channel|>" not in tok.all_special_tokens and "<|return|>" in tok.all_special_tokens

    # Gemma 4's channel and call markers (and the tool's answer) too, as llama.cpp's
    # converter makes them ordinary tokens; its turn markers stay special.
    tok = load_tokenizer(folder_with(GEMMA4, "gemma4"))
    reply = '<|channel>thought\nHm.<channel|><|tool_call>call:f{a:<|"|>b<|"|>}<tool_call|>'
    ids = tok.encode("<|turn>" + reply + "<|tool_response><turn|>")
    assert tok.decode(ids, skip_special_tokens=True) == reply + "<|tool_response>"
    assert "<|tool_call>" not in tok.all_special_tokens and "<turn|>" in tok.all_special_tokens

    tok = load_tokenizer(folder_with(["<|end|>"], "phi3"))
    assert tok.decode(tok.encode("a<|end|>"), skip_special_tokens=True) == "a"
