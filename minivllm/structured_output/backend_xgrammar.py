"""xgrammar: compiles grammar specs for one tokenizer (cached) and makes matchers."""

from __future__ import annotations

import re

import numpy as np
import torch
import xgrammar as xgr

from minivllm import envs
from minivllm.config import StructuredOutputsConfig
from minivllm.structured_output.grammar import GrammarSpec

# Whitespace characters allowed between two JSON tokens (enough for indented JSON).
# Unbounded (xgrammar's default) lets a small model emit newlines until max_tokens.
MAX_JSON_WHITESPACE = 8
CACHE_LIMIT_BYTES = 512 * 2**20

# xgrammar 0.2.8 writes a string with minLength/maxLength as `[^"\\\r\n]{m,n}`, which lets a
# raw tab or other control character into the string: not JSON (RFC 8259 wants them
# escaped; Python's json.loads refuses them). Its unbounded strings exclude \0-\x1f, so the
# bounded ones are given the same class.
_BOUNDED_STRING_CLASS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CLASS = '[^\\0-\\x1f\\"\\\\\\r\\n]'

# A rule of one character class, as xgrammar writes a bounded string's characters, and a
# string built from it: `"\"" NAME{m, n} "\""`.
_CLASS_RULE = re.compile(r"^(\S+) ::= \(\((\[(?:\\.|[^\]\\\n])*\])\)\)$", re.M)
_BOUNDED_STRING = re.compile(r'"\\"" (\S+)\{(\d+), (\d+)\} "\\""')
# Longest maxLength rewritten (one rule per character: compile time grows with it).
MAX_CHAINED_STRING_LENGTH = 128

# Unbounded runs of digits, as xgrammar writes a number's parts: `[0-9]*`, and a rule that
# is one digit (`NAME ::= (([0-9]))`) repeated `NAME{m, -1}`.
_DIGIT_RULE = re.compile(r"^(\S+) ::= \(\(\[0-9\]\)\)$", re.M)
_DIGIT_STAR = "[0-9]*"

# A JSON string with no length bound, as xgrammar writes it: a rule that is the closing
# quote, or a character and itself again, or an escape and itself again (then, perhaps, a
# lookahead for what may follow the string): `S ::= (("\"") | (C S) | ("\\" E S)) (=(...))`.
_FREE_STRING = re.compile(
    r'^(\S+) ::= \(\("\\""\) \| \((\[(?:\\.|[^\]\\\n])*\]) \1\) '
    r'\| \("\\\\" (\S+) \1\)\)( \(=.*\))?$',
    re.M,
)
# A string with a minLength but no maxLength: `"\"" NAME{m, -1} "\""`.
_MIN_ONLY_STRING = re.compile(r'"\\"" (\S+)\{(\d+), -1\} "\\""')


class XgrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        """stop_token_ids: the tokens that may end a completed grammar (None: the eos)."""
        # The model's vocabulary can be padded past the tokenizer's: the bitmask spans it all.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        # xgrammar keeps its own cache of compiled grammars, keyed by the spec; bounded as
        # vLLM bounds it (VLLM_XGRAMMAR_CACHE_MB, 512), or a server fed distinct schemas grows.
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )

    def compile(
        self,
        spec: GrammarSpec,
        any_whitespace: bool = True,
        max_string_length: int = StructuredOutputsConfig.json_max_string_length,
    ) -> xgr.CompiledGrammar:
        """max_string_length: the characters of a JSON string with no maxLength (0: no
        bound); StructuredOutputsConfig.json_max_string_length."""
        kind, text = spec
        if kind == "json_object":  # OpenAI's json_object: any JSON object
            kind, text = "json", '{"type": "object"}'
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(
                text, any_whitespace=any_whitespace, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
            ebnf = str(grammar).replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)
            ebnf = bound_digit_runs(ebnf, envs.MINIVLLM_JSON_MAX_DIGITS)
            ebnf = bound_free_strings(ebnf, max_string_length)
            chain_limit = max(MAX_CHAINED_STRING_LENGTH, max_string_length)
            return self.compiler.compile_grammar(chain_bounded_strings(ebnf, chain_limit))
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def only_stop_allowed(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether the matcher's grammar is complete and takes nothing but a stop token."""
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        mask = self.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        return set(np.flatnonzero(bits).tolist()) <= set(matcher.stop_token_ids)


def bound_digit_runs(ebnf: str, max_digits: int) -> str:
    """The JSON grammar with every unbounded run of digits cut at ``max_digits`` (0: left
    unbounded): an integer's digits after its first, a fraction's and an exponent's, as
    llama.cpp's JSON-schema grammars bound them. Without a bound a sampled model can write
    one number until max_tokens (`"id": 2538787922222...`), and the reply is not JSON."""
    if max_digits <= 0:
        return ebnf
    ebnf = ebnf.replace(_DIGIT_STAR, f"[0-9]{{0, {max_digits}}}")
    names = "|".join(re.escape(name) for name in _DIGIT_RULE.findall(ebnf))
    if not names:
        return ebnf
    return re.sub(
        rf"(?<![\w-])({names})\{{(\d+), -1\}}",
        lambda m: f"{m.group(1)}{{{m.group(2)}, {max(int(m.group(2)), max_digits)}}}",
        ebnf,
    )


def bound_free_strings(ebnf: str, max_length: int) -> str:
    """The JSON grammar with every string that has no maxLength cut at ``max_length``
    characters (0: left unbounded), an escape counting as one, as maxLength counts: the
    closing quote is the only token allowed after the last. A string with a minLength only
    gets max(minLength, max_length). Without a bound a sampled model can repeat itself in
    one string until max_tokens (`"notes": "300 300 300 ...`), and the reply is not JSON.

    The bounded string is a chain of rules that each may close it (as chain_bounded_strings
    writes them, so that its masks stay cheap to fill): r_k is the closing quote, or a
    character or an escape then r_(k-1); r_0 is the closing quote."""
    if max_length <= 0:
        return ebnf
    rules: list[str] = []

    def chain(match: re.Match) -> str:
        name, char, escape, lookahead = match.groups()
        base = f"{name}_capped"
        rules.append(f'{base}_0 ::= "\\""')
        rules.extend(
            f'{base}_{k} ::= "\\"" | ({char} {base}_{k - 1}) | ("\\\\" {escape} {base}_{k - 1})'
            for k in range(1, max_length + 1)
        )
        return f"{name} ::= (({base}_{max_length})){lookahead or ''}"

    ebnf = _MIN_ONLY_STRING.sub(
        lambda m: f'"\\"" {m.group(1)}{{{m.group(2)}, {max(int(m.group(2)), max_length)}}} "\\""',
        ebnf,
    )
    rewritten = _FREE_STRING.sub(chain, ebnf)
    if not rules:
        return ebnf
    if any(re.search(rf"^{re.escape(r.split()[0])} ::=", ebnf, re.M) for r in rules):
        return ebnf  # (a rule name already taken: leave the grammar as it is)
    return rewritten + "\n" + "\n".join(rules) + "\n"


def chain_bounded_strings(ebnf: str, max_length: int = MAX_CHAINED_STRING_LENGTH) -> str:
    """The same language with every bounded JSON string, `"\"" c{m, n} "\""`, written as a
    chain of rules that each end with the closing quote: `"\"" r_m`, where r_j is c r_(j-1),
    r_0 is q_(n-m), q_k is `"\"" | c q_(k-1)`, and q_0 is `"\""`.

    The masks are the same (the language is), but much cheaper to fill. xgrammar caches, for
    each position in a rule, which tokens the rule accepts or rejects on its own; only the
    tokens that run past the rule's end are checked against the stack at every step. In
    `c{m, n}`, the repeated rule is one character long, so every longer token runs past it:
    inside a bounded string nearly the whole vocabulary was checked at every step (1-7 ms
    per row for SmolLM2's 49,152 tokens). In the chain, a rule runs to the closing quote:
    a token that overruns the length is rejected by the rule itself, and only the tokens
    that close the string are left to check."""
    classes = dict(_CLASS_RULE.findall(ebnf))
    rules: list[str] = []
    done: dict[str, str] = {}

    def chain(match: re.Match) -> str:
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if name not in classes or high > max_length or low > high:
            return match.group(0)
        base = f"{name}_chain_{low}_{high}"
        if base not in done:
            char = classes[name]
            rules.append(f'{base}_q0 ::= "\\""')
            rules.extend(
                f'{base}_q{k} ::= "\\"" | ({char} {base}_q{k - 1})'
                for k in range(1, high - low + 1)
            )
            rules.append(f"{base}_r0 ::= {base}_q{high - low}")
            rules.extend(f"{base}_r{j} ::= {char} {base}_r{j - 1}" for j in range(1, low + 1))
            done[base] = f'"\\"" {base}_r{low}'
        return done[base]

    rewritten = _BOUNDED_STRING.sub(chain, ebnf)
    if not rules:
        return ebnf
    if any(re.search(rf"^{re.escape(r.split()[0])} ::=", ebnf, re.M) for r in rules):
        return ebnf  # (a rule name already taken: leave the grammar as it is)
    return rewritten + "\n" + "\n".join(rules) + "\n"
