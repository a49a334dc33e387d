"""Load the tokenizer of a local Hugging Face model directory or GGUF file.

Converting a GGUF vocabulary to a fast tokenizer takes seconds, so the result is saved
once under the cache folder and loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from minivllm import envs
from minivllm.model.loader import is_gguf, load_generation_config, read_gguf_header

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# transformers (and the torch it imports) is imported where a tokenizer is loaded, not with
# this module: the frontend starts the engine core process before it pays for them.

logger = logging.getLogger(__name__)


def _cache_root() -> str:
    return envs.MINIVLLM_CACHE_DIR


def _gguf_cache_dir(path: str) -> str:
    # A file replaced in place gets a new size or mtime, hence a new key; the transformers
    # version is part of the key because the conversion can change between releases.
    import transformers

    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(_cache_root(), "tokenizers", digest)


def _convert_gguf(path: str) -> PreTrainedTokenizerBase:
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    # Not AutoTokenizer: to pick a tokenizer class it parses the whole file with GGUFReader
    # and imports the model's config class (4.5 s for SmolLM2, 12 s for Qwen2.5-0.5B here),
    # and every class builds the same tokenizers backend from a GGUF anyway.
    tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    meta = read_gguf_header(path).metadata
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None and tok.eos_token_id != eos_id:
        tok.eos_token = tok.convert_ids_to_tokens(int(eos_id))
    template = meta.get("tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    return tok


def _save_to_cache(tok: PreTrainedTokenizerBase, cache_dir: str) -> None:
    parent = os.path.dirname(cache_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        # Save beside the target and rename, so a concurrent reader never sees half a save.
        tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cache_dir)
        except OSError:  # another process finished first; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:  # a read-only or full cache only costs speed
        logger.warning("could not cache the tokenizer in %s: %s", cache_dir, err)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of a model directory or GGUF file.

    A GGUF's converted tokenizer is cached under ``$MINIVLLM_CACHE_DIR`` (default
    ``~/.cache/minivllm``), keyed by the file's path, size and mtime.
    """
    return render_message_markers(_load(os.path.expanduser(os.fspath(path))))


def _load(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        raise FileNotFoundError(f"not a model directory or .gguf file: {path}")

    cache_dir = _gguf_cache_dir(path)
    if os.path.isdir(cache_dir):
        try:
            # What _convert_gguf saved (AutoTokenizer would read the same class, after
            # importing its class table: 0.6 s).
            return PreTrainedTokenizerFast.from_pretrained(cache_dir)
        except (OSError, ValueError) as err:  # a damaged cache entry: convert again
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cache_dir, err)
            shutil.rmtree(cache_dir, ignore_errors=True)
    tok = _convert_gguf(path)
    _save_to_cache(tok, cache_dir)
    return tok


# gpt-oss's harmony format: the tokens that frame each message of a reply, <|start|>{role}
# <|channel|>{channel}<|message|>{text}<|end|>, with <|constrain|> before a tool call's
# format. They are special tokens, so a decoded reply would lose them ("analysis...
# assistantfinal..."); as llama.cpp, they are rendered, and the reasoning parser
# (openai_gptoss) splits the reply at them.
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
# Gemma 4's: its thinking channel (<|channel>thought\n...<channel|>), its tool calls
# (<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>) and the tool's answer; llama.cpp's
# converter makes these seven ordinary tokens, and the gemma4 parsers read them.
_GEMMA4_MARKERS = (
    "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
    "<tool_response|>", '<|"|>',
)  # fmt: skip


def _rendered_markers(added: dict) -> tuple[str, ...]:
    """The markers of a vocabulary's message format that a decode keeps (none for most)."""
    if all(t in added for t in ("<|channel|>", "<|message|>", *_HARMONY_TURN_ENDS)):
        return _HARMONY_MARKERS
    if all(t in added for t in _GEMMA4_MARKERS[:4]):
        return _GEMMA4_MARKERS
    return ()


def render_message_markers(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """In a harmony vocabulary (one with <|channel|>, <|message|>, <|return|>, <|call|>)
    or Gemma 4's, the message markers become ordinary added tokens, kept by a decode that
    skips special tokens; other tokenizers are returned as they are."""
    added = {token.content: token for token in tok.added_tokens_decoder.values()}
    markers = _rendered_markers(added)
    if not markers:
        return tok
    backend = getattr(tok, "_tokenizer", None)
    if backend is None:  # not a fast tokenizer: left as it is
        return tok
    from tokenizers import Tokenizer

    # The backend keeps each added token's flag as first registered: rebuild it.
    state = json.loads(backend.to_str())
    for token in state["added_tokens"]:
        if token["content"] in markers:
            token["special"] = False
    tok._tokenizer = Tokenizer.from_str(json.dumps(state))
    extra = getattr(tok, "extra_special_tokens", [])
    tok.extra_special_tokens = [t for t in extra if t not in markers]
    return tok


# Special tokens that end a turn, on which llama.cpp stops a GGUF model's generation
# whatever the file's eos says: Gemma's <end_of_turn> (its eos is <eos>), Phi-3's <|end|>,
# Llama 3's <|eot_id|>/<|eom_id|>, ChatML's <|im_end|>, <|endoftext|>, gpt-oss's <|return|>
# and <|call|>.
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<|return|>",
        "<|call|>",
        "<turn|>",  # Gemma 4's end of turn, and its call's wait for a tool's answer
        "<|tool_response>",
    }
)
# gpt-oss's harmony format closes every message with <|end|>, its reasoning too, and ends
# the turn with <|return|> (or <|call|> for a tool): as llama.cpp, a vocabulary with both
# of those does not stop on <|end|>.
_HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")


def end_of_generation_ids(
    model: str, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> list[int]:
    """Token ids besides the tokenizer's eos that end a generation (those in the model's
    vocabulary).

    A model directory: its generation_config.json's ``eos_token_id`` (Llama 3 Instruct
    lists <|eom_id|> and <|eot_id|> there), which vLLM adds to every request's stop token
    ids. A GGUF file: its eot/eom token ids and its special end-of-turn tokens, on which
    llama.cpp stops; and the generation config of the tokenizer's directory, if one is set.
    """
    ids: set[int] = set()
    folders = [model] if os.path.isdir(model) else []
    if tokenizer is not None and os.path.isdir(tokenizer.name_or_path):
        folders.append(tokenizer.name_or_path)
    if is_gguf(model):
        meta = read_gguf_header(model).metadata
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if meta.get(key) is not None:
                ids.add(int(meta[key]))
        if tokenizer is not None:
            added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
            markers = _rendered_markers(added)
            specials = {
                token.content: token_id
                for token_id, token in tokenizer.added_tokens_decoder.items()
                if token.special or token.content in markers  # (Gemma 4's <|tool_response>)
            }
            ids.update(i for text, i in specials.items() if text in _END_OF_TURN_TEXTS)
            if all(text in specials for text in _HARMONY_TURN_ENDS):
                ids.discard(specials.get("<|end|>"))
    for folder in dict.fromkeys(folders):
        eos = load_generation_config(folder).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else [t for t in eos or () if isinstance(t, int)])
    if tokenizer is not None:
        ids.discard(tokenizer.eos_token_id)
    return sorted(t for t in ids if 0 <= t < vocab_size)
