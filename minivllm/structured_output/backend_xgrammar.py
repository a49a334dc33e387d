"""xgrammar: compiles grammar specs for one tokenizer (cached) and makes matchers."""

from __future__ import annotations

import torch
import xgrammar as xgr

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


class XgrammarBackend:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        # The model's vocabulary can be padded past the tokenizer's: the bitmask spans it all.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        # xgrammar keeps its own cache of compiled grammars, keyed by the spec; bounded as
        # vLLM bounds it (VLLM_XGRAMMAR_CACHE_MB, 512), or a server fed distinct schemas grows.
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )

    def compile(self, spec: GrammarSpec, any_whitespace: bool = True) -> xgr.CompiledGrammar:
        kind, text = spec
        if kind == "json_object":  # OpenAI's json_object: any JSON object
            kind, text = "json", '{"type": "object"}'
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(
                text, any_whitespace=any_whitespace, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
            ebnf = str(grammar).replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)
            return self.compiler.compile_grammar(ebnf)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)
