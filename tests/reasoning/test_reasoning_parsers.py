"""deepseek_r1, qwen3 and gemma4: every split of a scripted output streams exactly the whole-output
(reasoning_content, content)."""

from __future__ import annotations

import pytest

from minivllm.reasoning import ReasoningParserManager
from tests.entrypoints.openai.tool_parsers.utils import splits

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # the template opened the block
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking turned off


def stream(parser, pieces, prompt):
    reasoning, content = [], []
    previous = ""
    for k, piece in enumerate(pieces):
        delta = parser.extract_reasoning_content_streaming(
            previous, previous + piece, piece, prompt=prompt, finished=k == len(pieces) - 1
        )
        previous += piece
        if delta is not None:
            assert delta.reasoning_content or delta.content, "an empty delta is None"
            reasoning.append(delta.reasoning_content or "")
            content.append(delta.content or "")
    return "".join(reasoning) or None, "".join(content) or None


def check(name, text, prompt=None):
    make = ReasoningParserManager.get_reasoning_parser(name)
    expected = make().extract_reasoning_content(text, prompt=prompt)
    for pieces in splits(text):
        assert stream(make(), pieces, prompt) == expected, pieces
    return expected


@pytest.mark.parametrize(
    "text, prompt, expected",
    [
        ("<think>Let me see.</think>The answer is 4.", None, ("Let me see.", "The answer is 4.")),
        ("Let me see.</think>\n\n4", None, ("Let me see.", "\n\n4")),  # template opened it
        ("<think>still thinking", None, ("still thinking", None)),
        ("no tags at all", None, ("no tags at all", None)),
        ("<think></think>answer", None, (None, "answer")),
        ("a </thin b</think>c", None, ("a </thin b", "c")),
        ("<thi", None, ("<thi", None)),
        ("", None, (None, None)),
    ],
)
def test_deepseek_r1(text, prompt, expected):
    assert check("deepseek_r1", text, prompt) == expected


@pytest.mark.parametrize(
    "text, prompt, expected",
    [
        ("<think>\nLet me see.\n</think>\n\nIt is 4.", None, ("\nLet me see.\n", "\n\nIt is 4.")),
        ("It is 4.", CLOSED_PROMPT, (None, "It is 4.")),  # enable_thinking=False
        ("It is 4, not </think> here.", None, (None, "It is 4, not </think> here.")),
        ("Let me see.</think>It is 4.", OPEN_PROMPT, ("Let me see.", "It is 4.")),
        ("<think>cut off", None, ("cut off", None)),
        ("<thi", None, (None, "<thi")),
        ("<thinking>", None, (None, "<thinking>")),
    ],
)
def test_qwen3(text, prompt, expected):
    assert check("qwen3", text, prompt) == expected


def test_structured_output_starts_after_the_reasoning():
    r1 = ReasoningParserManager.get_reasoning_parser("deepseek_r1")()
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")()
    assert r1.reasoning_end_marker(OPEN_PROMPT) == "</think>"
    assert qwen3.reasoning_end_marker("<|im_start|>assistant\n") == "</think>"
    assert qwen3.reasoning_end_marker(CLOSED_PROMPT) is None  # the answer starts at once
    assert set(ReasoningParserManager.names()) >= {"deepseek_r1", "qwen3"}


A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get <|constrain|>json<|message|>"
    '{"city": "Paris"}'
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (f"{A}Two and two.<|end|>{F}It is 4.", ("Two and two.", "It is 4.")),
        ("<|channel|>final<|message|>4", (None, "4")),  # no reasoning
        (f"{A}cut off", ("cut off", None)),
        (f"{A}a <|en b<|end|><|start|>assistant<|channel|>fin", ("a <|en b", None)),
        # a tool call's message (commentary, a recipient, a format) stays whole in the
        # content, for the openai tool parser
        (
            f"{A}Weather.<|end|>{CALL}",
            ("Weather.", CALL),
        ),
        ("<|channel|>commentary<|message|>Checking.<|end|>", (None, "Checking.")),
        ("plain text, not harmony", (None, "plain text, not harmony")),
        ("<", (None, "<")),
        ("", (None, None)),
    ],
)
def test_openai_gptoss(text, expected):
    """Harmony replies with their markers rendered (tokenizer.py): the analysis channel is
    the reasoning, the other channels' messages the content."""
    assert check("openai_gptoss", text) == expected
    parser = ReasoningParserManager.get_reasoning_parser("openai_gptoss")()
    assert parser.reasoning_end_marker(None) == "<|channel|>final<|message|>"


@pytest.mark.parametrize(
    "text, prompt, expected",
    [
        (
            "<|channel>thought\nLet me see.<channel|>It is 4.",
            None,
            ("Let me see.", "It is 4."),  # the channel's label is not reasoning
        ),
        ("It is 4.", None, (None, "It is 4.")),  # thinking off: no channel
        ("<|channel>thought\nstill thinking", None, ("still thinking", None)),
        ("<|channel>thought\n<channel|>", None, (None, None)),
        ("Then <channel|> here.", None, (None, "Then <channel|> here.")),
        ("more.<channel|>4", "<|turn>model\n<|channel>thought\n", ("more.", "4")),
        ("<|chan", None, (None, "<|chan")),
    ],
)
def test_gemma4(text, prompt, expected):
    assert check("gemma4", text, prompt) == expected
