"""The stop-string index against a plain scan: the first stop string completed by the new
text (at the same character, the one listed first), for random texts and strings; work
per character that does not grow with the number of strings."""

from __future__ import annotations

import random

from minivllm.engine.stop_strings import StopStringMatcher


def scan(stops: list[str], text: str, new_chars: int) -> tuple[int, str] | None:
    best = None
    for order, stop in enumerate(stops):
        if not stop:
            continue
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            key = (index + len(stop), order)
            if best is None or key < best[0]:
                best = (key, (index, stop))
    return best[1] if best else None


def test_the_index_finds_what_a_scan_finds():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choices("abc", k=rng.randint(0, 4))) for _ in range(rng.randint(0, 6))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 12)))
        new_chars = rng.randint(0, len(text))
        assert StopStringMatcher(stops).find(text, new_chars) == scan(stops, text, new_chars)


def test_a_match_may_span_earlier_text_but_must_end_in_the_new():
    matcher = StopStringMatcher(["hello", "lo w"])
    assert matcher.find("say hello", 2) == (4, "hello")
    assert matcher.find("say hello", 0) is None
    assert matcher.find("hello world", 5) == (3, "lo w")
    assert matcher.find("hello world", 4) is None
    assert matcher.max_length == 5 and StopStringMatcher([]).find("x", 1) is None


def test_many_strings_cost_lookups_per_length_not_per_string():
    """100,000 strings of 3 lengths: a character costs at most 3 set lookups."""
    stops = [f"{i:05d}" for i in range(100_000)] + ["zz", "zzzzzzzzzz"]
    matcher = StopStringMatcher(stops)
    lookups = 0

    class Counting(set):
        def __contains__(self, item):
            nonlocal lookups
            lookups += 1
            return super().__contains__(item)

    matcher._sets = [Counting(s) for s in matcher._sets]
    text = "the answer is 4 and then 1234"
    assert matcher.find(text, len(text)) is None
    assert lookups <= 3 * len(text)
    assert matcher.find(text + "5", 1) == (25, "12345")
