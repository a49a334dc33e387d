"""Fill in the middle (FIM): the text between a prefix and a suffix, for the code models
trained for it (Qwen2.5-Coder and Qwen3-Coder, StarCoder2, DeepSeek-Coder, CodeLlama,
CodeGemma). The prompt is laid out prefix, suffix, middle with the model's own three tokens,
as llama.cpp's /infill and Ollama's templates lay it out, and the model writes the middle.
Editors' code completion sends it (`suffix` on /v1/completions and Ollama's /api/generate);
vLLM's completions refuse `suffix`."""

from __future__ import annotations

from dataclasses import dataclass

# Each family's (prefix, suffix, middle) tokens, as their tokenizers (and GGUF vocabularies)
# spell them.
_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5/3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
)
# Tokens that end a middle where the model's end of text does not (llama.cpp's end-of-
# generation set for FIM): the padding and file separators, CodeLlama's end of infill.
_END_SPELLINGS = ("<|fim_pad|>", "<|file_sep|>", "<file_sep>", "<|file_separator|>", "▁<EOT>")


@dataclass(frozen=True)
class FillInMiddle:
    """A tokenizer's FIM tokens: how to lay out a prompt, and where a middle ends."""

    prefix: int
    suffix: int
    middle: int
    bos: tuple[int, ...]  # the tokenizer's BOS when it starts its prompts with one
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> FillInMiddle | None:
        """The tokenizer's FIM tokens, or None for a model not trained to fill in."""
        vocab = tokenizer.get_vocab()
        for spelling in _SPELLINGS:
            ids = [vocab.get(token) for token in spelling]
            if None not in ids:
                break
        else:
            return None
        starts = tokenizer.encode("a")
        bos = getattr(tokenizer, "bos_token_id", None)
        ends = tuple(vocab[t] for t in _END_SPELLINGS if t in vocab)
        return cls(
            *ids, bos=(bos,) if bos is not None and starts[:1] == [bos] else (), end_ids=ends
        )

    def prompt_ids(self, tokenizer, prefix: str, suffix: str) -> list[int]:
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False) if text else []

        return [*self.bos, self.prefix, *encode(prefix), self.suffix, *encode(suffix), self.middle]
