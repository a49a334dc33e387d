"""From a request's text to token ids, off the event loop: chat templates, tokenization and
the checks that come before it (UTF-8, a length bound that needs no tokenizing)."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.protocol import ChatMessageParam
from minivllm.sampling_params import check_utf8

T = TypeVar("T")

# Tokenization and chat templating run here, off the event loop, so that a big prompt never
# stalls other requests or /health. One thread: a fast tokenizer must not be used by two
# threads at once (transformers sets its truncation state on every call).
_TOKENIZER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-tokenize")


async def in_tokenizer_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZER_POOL, functools.partial(fn, *args, **kwargs))


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer) -> int | None:
    """The most characters one token can stand for, when the tokenizer makes that a bound.

    With a byte-level tokenizer and no normalizer, every character of a text is at least one
    byte of some token's string, so a text of C characters has at least C / this many
    tokens: a prompt far longer than the context is refused before it is tokenized. None
    (no bound) for tokenizers whose normalizer may shrink a text (e.g. collapse spaces).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=None)


# Keys of chat_template_kwargs that the server sets itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
    }
)


# Around a held message content's number while the chat template renders: private-use
# characters, which no template changes.
_MARKER_OPEN, _MARKER_CLOSE = "\ue000", "\ue001"


class ChatLikeRequest(Protocol):
    """What render_chat reads of a chat, chat-embedding or chat-tokenize request."""

    messages: list[ChatMessageParam]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None


@dataclass
class RenderedChat:
    """A chat prompt: its text, and with --tokenize-content-as-text, where a message's
    content spells a special token, the text cut into (piece, is it message content)."""

    text: str
    pieces: list[tuple[str, bool]] | None = None


class PromptTokenization:
    """The handlers' text-to-ids steps; needs `tokenizer`, `max_model_len`,
    `chat_template` (None: the tokenizer's) and `content_as_text` (tokenize message
    contents without special tokens) on the handler."""

    tokenizer: Any
    max_model_len: int
    chat_template: str | None
    content_as_text: bool = False
    # --default-chat-template-kwargs: under every request's own.
    default_chat_template_kwargs: dict[str, Any] | None = None

    def encode(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.truncate(ids, truncate)

    def check_text(self, text: str, param: str, check_length: bool = True) -> None:
        """Refuse, before tokenizing, a text that is not UTF-8 or cannot fit the context."""
        try:
            check_utf8(text, f"`{param}`")
        except ValueError as exc:
            raise BadRequestError(str(exc), param=param) from None
        if check_length:
            self.check_num_chars(len(text), param)

    def check_num_chars(self, num_chars: int, param: str) -> None:
        chars_per_token = max_chars_per_token(self.tokenizer)
        if chars_per_token and num_chars > chars_per_token * self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_chars} characters, more than {self.max_model_len} tokens "
                "can hold. Please reduce the length of the prompt.",
                param=param,
            )

    async def encode_async(
        self,
        text: str,
        add_special_tokens: bool,
        truncate: int | None = None,
        param: str = "prompt",
        check_length: bool = True,
    ) -> list[int]:
        """encode() off the event loop, after check_text() (no length check when truncating)."""
        self.check_text(text, param, check_length and truncate is None)
        return await in_tokenizer_thread(self.encode, text, add_special_tokens, truncate)

    async def render_chat(
        self, request: ChatLikeRequest, check_length: bool = True
    ) -> RenderedChat:
        """The request's messages (and tools, if any) through the chat template, off the event
        loop, after check_text() on every message (check_length: the prompt's length too)."""
        contents = [m.to_template_dict()["content"] for m in request.messages]
        for content in contents:
            self.check_text(content, "messages", check_length=False)
        if check_length:
            self.check_num_chars(sum(len(c) for c in contents), "messages")
        kwargs = {**(self.default_chat_template_kwargs or {}),
                  **(request.chat_template_kwargs or {})}  # fmt: skip
        tools = getattr(request, "tools", None)
        if tools:  # as vLLM: the template sees them even with tool_choice "none"
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        effort = getattr(request, "reasoning_effort", None)
        if effort is not None:  # as vLLM: templates that take it (gpt-oss's) read it
            kwargs.setdefault("reasoning_effort", effort)
        return await in_tokenizer_thread(
            self.apply_chat_template,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            kwargs or None,
        )

    async def encode_chat_async(
        self,
        chat: RenderedChat,
        add_special_tokens: bool,
        truncate: int | None = None,
        param: str = "messages",
        check_length: bool = True,
    ) -> list[int]:
        """A rendered chat's token ids, off the event loop: its pieces of message content
        (--tokenize-content-as-text) without special tokens, the rest as encode()."""
        if chat.pieces is None:
            return await self.encode_async(
                chat.text, add_special_tokens, truncate, param, check_length
            )
        self.check_text(chat.text, param, check_length and truncate is None)
        return await in_tokenizer_thread(
            self._encode_pieces, chat.pieces, add_special_tokens, truncate
        )

    def _encode_pieces(
        self, pieces: list[tuple[str, bool]], add_special_tokens: bool, truncate: int | None
    ) -> list[int]:
        ids: list[int] = []
        for text, is_content in pieces:
            ids += self.tokenizer.encode(
                text, add_special_tokens=False, split_special_tokens=is_content
            )
        if add_special_tokens:
            ids = self.tokenizer.build_inputs_with_special_tokens(ids)
        return self.truncate(ids, truncate)

    @staticmethod
    def truncate(ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `truncate` tokens."""
        return ids[-truncate:] if truncate is not None and len(ids) > truncate else ids

    def apply_chat_template(
        self,
        messages: list[ChatMessageParam],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> RenderedChat:
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise BadRequestError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}.",
                param="chat_template_kwargs",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise BadRequestError(
                "continue_final_message needs the last message to be the assistant's.",
                param="messages",
            )
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "This model has no chat template: start the server with --chat-template, "
                "or use /v1/completions.",
                param="messages",
            )
        conversation = [m.to_template_dict() for m in messages]
        # Contents that spell a special token, each replaced by a marker while rendering, so
        # that the rendered prompt can be cut at them (--tokenize-content-as-text).
        held = {}
        if self.content_as_text:
            for message in conversation:
                if _spells_special_token(message["content"], self.tokenizer):
                    marker = f"{_MARKER_OPEN}{len(held)}{_MARKER_CLOSE}"
                    held[marker], message["content"] = message["content"], marker
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # jinja2 errors raised by the template itself, mostly
            raise BadRequestError(
                f"Could not apply the chat template: {exc}", param="messages"
            ) from exc
        if not held:
            return RenderedChat(text)
        return _cut_at_markers(text, held)


def _spells_special_token(content: str, tokenizer) -> bool:
    return any(token in content for token in _special_token_texts(tokenizer))


@functools.lru_cache(maxsize=8)
def _special_token_texts(tokenizer) -> tuple[str, ...]:
    """The texts the tokenizer turns into special (control) tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", ()) or ())
    return tuple(t for t in texts if t)


def _cut_at_markers(text: str, held: dict[str, str]) -> RenderedChat:
    """The rendered prompt with the held contents back in place, cut into pieces; a 400 if
    the template did not keep each marker once (it changed a content: no safe cut)."""
    pattern = re.compile(re.escape(_MARKER_OPEN) + r"\d+" + re.escape(_MARKER_CLOSE))
    pieces: list[tuple[str, bool]] = []
    start, seen = 0, []
    for match in pattern.finditer(text):
        if match.group() not in held:
            continue
        pieces.append((text[start : match.start()], False))
        pieces.append((held[match.group()], True))
        seen.append(match.group())
        start = match.end()
    pieces.append((text[start:], False))
    if sorted(seen) != sorted(held):
        raise BadRequestError(
            "A message's content holds a special token's text, and this model's chat template "
            "changes message contents, so it cannot be kept as text "
            "(--tokenize-content-as-text).",
            param="messages",
        )
    pieces = [(piece, is_content) for piece, is_content in pieces if piece]
    return RenderedChat("".join(piece for piece, _ in pieces), pieces)
