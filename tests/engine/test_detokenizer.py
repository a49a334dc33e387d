"""Incremental detokenization: never a broken character; stop strings across tokens."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams


def stream(tokenizer, text: str, params: SamplingParams, prompt: str = "Say:"):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    ids = tokenizer.encode(text)
    texts, stop = [], None
    for n, token_id in enumerate(ids, start=1):
        stop = detok.update([token_id], n)
        texts.append(detok.output_text)
        if stop is not None:
            break
    return detok, texts, stop


def test_cjk_and_emoji_are_never_split(smollm2_tokenizer):
    text = " 你好，世界！🙂👍🏽 café ñandú"
    detok, texts, _ = stream(smollm2_tokenizer, text, SamplingParams())
    assert detok.output_text == text
    assert all("\ufffd" not in t for t in texts)
    # Some tokens carried only part of a character: the text did not grow on those.
    assert len(set(texts)) < len(texts)


def test_stop_string_across_token_boundary(smollm2_tokenizer):
    text = " The weather today is sunny and warm."
    ids = smollm2_tokenizer.encode(text)
    pieces = [smollm2_tokenizer.decode([t]) for t in ids]
    stop = pieces[2][-2:] + pieces[3][:2]  # spans two tokens
    detok, _, found = stream(smollm2_tokenizer, text, SamplingParams(stop=[stop]))
    assert found == stop
    assert detok.output_text == text[: text.index(stop)]
    detok, _, _ = stream(
        smollm2_tokenizer, text, SamplingParams(stop=[stop], include_stop_str_in_output=True)
    )
    assert detok.output_text == text[: text.index(stop) + len(stop)]


def test_text_that_could_start_a_stop_string_is_held_back(smollm2_tokenizer):
    params = SamplingParams(stop=["STOP HERE"])
    detok, _, _ = stream(smollm2_tokenizer, " abc def", params)
    held = len("STOP HERE") - 1
    assert detok.get_text(finished=False, sent_offset=0) == detok.output_text[:-held]
    assert detok.get_text(finished=True, sent_offset=0) == detok.output_text


def test_min_tokens_delays_stop_strings(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(stop=["a"], min_tokens=5))
    ids = smollm2_tokenizer.encode("a a a a a a")
    stops = [detok.update([t], n) for n, t in enumerate(ids, start=1)]
    assert stops[:4] == [None] * 4
    assert "a" in stops[4:]


def test_a_stray_byte_after_a_whole_character_does_not_fail_the_request():
    """SentencePiece's byte fallback (Gemma 3's tokenizer) decodes a run of byte tokens as
    one: the bytes of "ॣ" then a lone lead byte make four replacement marks, so the text
    already sent stops being a prefix and DecodeStream raises (a Gemma 3 request sampled at
    temperature 1 failed on it). The text sent stays and decoding goes on."""
    vocab = {"<unk>": 0, "<0xE0>": 1, "<0xA5>": 2, "<0xA3>": 3, "\u2581gravy": 4, "\u2581a": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    detok = IncrementalDetokenizer(tokenizer, [5], SamplingParams())
    for n, token_id in enumerate([1, 2, 3, 1, 4, 5], start=1):
        assert detok.update([token_id], n) is None
    assert detok.output_text == "\u0963gravy a"


def test_tokens_after_the_stop_string_in_one_update_are_not_read(smollm2_tokenizer):
    """Speculative decoding delivers several tokens a step: the stop string may end at any."""
    text = " one two three four five"
    ids = smollm2_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(stop=["three"]))
    assert detok.update(ids[:2], 2) is None
    assert detok.update(ids[2:], len(ids)) == "three"
    assert detok.num_unread == len(ids) - 3  # " four five" came with it, unread
    assert detok.output_text == " one two "
    # min_tokens counts each token of the update: "a" at the 2nd of 4 tokens is too early.
    ids = smollm2_tokenizer.encode("a b a b")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1], SamplingParams(stop=["a"], min_tokens=2))
    assert detok.update(ids, len(ids)) == "a" and detok.num_unread == 1
