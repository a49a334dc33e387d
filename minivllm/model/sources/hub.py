"""Models from the Hugging Face Hub, through ``huggingface_hub`` and its local cache.

An ``org/name`` checkpoint downloads what loading reads (config, generation config,
safetensors and their index, tokenizer files), an ``org/name-GGUF:QUANT`` repo the one
GGUF file of that quantization (every part of a split file); a second start finds them in
the cache and downloads nothing, and a download cut short resumes on the next run
(``resumable.py``). ``huggingface_hub`` does the transfers: its progress
bars, retries, ``HF_TOKEN``, ``HF_HOME`` / ``HF_HUB_CACHE`` and
``HF_ENDPOINT``. ``HF_HUB_OFFLINE=1`` reads the cache only. Its errors become one line.
"""

from __future__ import annotations

import errno
import os
import re

from minivllm.model.sources.errors import ModelSourceError
from minivllm.model.sources.hf_cache import (
    cached_snapshot,
    hf_hub_cache_dir,
    is_complete_checkpoint,
    snapshot_files,
)
from minivllm.model.sources.resumable import prefetch_blob

# "name" or "org/name" (letters, digits, -, _, .), optionally ":QUANT" for a GGUF repo.
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(/[\w.-]+)?)(:(?P<quant>[\w.-]+))?$")
# What loading an HF checkpoint reads; nothing else of the repo is downloaded.
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "preprocessor_config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/*",
    "adapter_config.json",
]
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_QUANT_TYPE = re.compile(r"^(I?Q\d\w*|F16|BF16|F32|MXFP4\w*|TQ\d\w*)$", re.IGNORECASE)


def is_hub_name(name: str) -> bool:
    return bool(_HUB_NAME.match(name)) and not name.endswith(".gguf") and ".." not in name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub(
    name: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_file: str | None = None,
) -> str:
    """The local path of a Hub model: its cached copy when the cache holds all of it (no
    network: a second start is as quick as the first was not), else downloaded into it."""
    m = _HUB_NAME.match(name)
    assert m is not None  # is_hub_name held
    repo, quant = m.group("repo"), m.group("quant")
    cache_dir = os.path.expanduser(download_dir) if download_dir else None
    cache = cache_dir or hf_hub_cache_dir()
    found = _cached(repo, revision, cache, quant, hf_file)
    if found is not None:
        return found
    try:
        if _offline():
            from huggingface_hub.errors import OfflineModeIsEnabled

            raise OfflineModeIsEnabled("HF_HUB_OFFLINE=1")
        from huggingface_hub import HfApi

        files = HfApi().list_repo_files(repo, revision=revision)
        wanted = _gguf_files(repo, files, quant, hf_file)
        if wanted:
            return _download_files(repo, wanted, revision, cache_dir)
        return _download_checkpoint(repo, files, revision, cache_dir)
    except ModelSourceError:
        raise
    except Exception as e:  # huggingface_hub's and the network's errors, each said once
        raise ModelSourceError(_explain(name, e, cache)) from None


def _cached(
    repo: str, revision: str | None, cache: str, quant: str | None, hf_file: str | None
) -> str | None:
    """The model's path in the cache when every file it needs is there, else None."""
    snapshot = cached_snapshot(repo, revision, cache)
    if snapshot is None:
        return None
    files = snapshot_files(snapshot)
    try:
        wanted = _gguf_files(repo, files, quant, hf_file)
    except ModelSourceError:
        return None  # not this quantization yet: the Hub's list decides
    if wanted:
        return os.path.join(snapshot, wanted[0])
    return snapshot if is_complete_checkpoint(snapshot, files) else None


def _gguf_files(repo: str, files: list[str], quant: str | None, hf_file: str | None) -> list[str]:
    """The GGUF file(s) to fetch; [] for an HF checkpoint (a config.json and no choice)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if hf_file:
        if hf_file not in files:
            raise ModelSourceError(
                f"{repo!r} has no file {hf_file!r} on the Hub; its GGUF files: "
                f"{', '.join(ggufs) or 'none'}."
            )
        return _with_split_parts(hf_file, files)
    if quant is None:
        if "config.json" in files or not ggufs:
            return []
        quants = sorted({quant_of(f) for f in ggufs})
        if len(quants) > 1:
            raise ModelSourceError(
                f"{repo!r} holds several GGUF quantizations ({', '.join(quants)}): name one, "
                f"e.g. {repo}:{quants[0]}, or pick a file with --hf-file."
            )
        return _with_split_parts(ggufs[0], files)
    matching = [f for f in ggufs if quant_of(f).lower() == quant.lower()]
    if not matching:
        quants = sorted({quant_of(f) for f in ggufs})
        raise ModelSourceError(
            f"{repo!r} has no {quant} GGUF file; its quantizations: "
            f"{', '.join(quants) or 'none (no .gguf file)'}."
        )
    return _with_split_parts(matching[0], files)


def quant_of(filename: str) -> str:
    """'Qwen3-4B-Q4_K_M.gguf' and 'Q4_K_M/x-00001-of-00002.gguf' -> 'Q4_K_M'."""
    stem = _SPLIT.sub("", os.path.basename(filename)).removesuffix(".gguf")
    token = re.split(r"[.\-]", stem)[-1]
    if not _QUANT_TYPE.match(token) and os.path.dirname(filename):
        return os.path.basename(os.path.dirname(filename))  # a folder per quantization
    return token


def _with_split_parts(first: str, files: list[str]) -> list[str]:
    """A split file's every part (``-0000k-of-0000N.gguf``), the first part first."""
    m = _SPLIT.search(first)
    if m is None:
        return [first]
    prefix = first[: m.start()]
    count = int(m.group(2))
    parts = [f"{prefix}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise ModelSourceError(f"split GGUF {first!r} misses its parts {', '.join(missing)}.")
    return parts


def _download_files(repo: str, names: list[str], revision: str | None, cache: str | None) -> str:
    from huggingface_hub import hf_hub_download

    for name in names:
        prefetch_blob(repo, name, revision, cache)
    paths = [hf_hub_download(repo, name, revision=revision, cache_dir=cache) for name in names]
    return paths[0]


def _download_checkpoint(
    repo: str, files: list[str], revision: str | None, cache_dir: str | None
) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    for name in filter_repo_objects(files, allow_patterns=CHECKPOINT_FILES):
        prefetch_blob(repo, name, revision, cache_dir)
    return snapshot_download(
        repo,
        revision=revision,
        cache_dir=cache_dir,
        allow_patterns=CHECKPOINT_FILES,
    )


def _explain(name: str, error: Exception, cache: str) -> str:
    """One line: what went wrong with which model, and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    resume = "run it again"
    if isinstance(error, GatedRepoError):
        return (
            f"Model {name!r} is gated on the Hub ({endpoint}): accept its terms on its page "
            f"and set HF_TOKEN to a token of an account with access."
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"Model {name!r} was not found on the Hub ({endpoint}): check the name, set "
            f"HF_TOKEN if it is private, or pass a local folder or .gguf file."
        )
    if isinstance(error, RevisionNotFoundError):
        return f"Model {name!r} has no such revision on the Hub ({endpoint}): check --revision."
    if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or _offline():
        return (
            f"Model {name!r} is not in the local Hugging Face cache ({cache}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE on a machine "
            f"with access to {endpoint}, or pass a local folder or .gguf file."
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return (
            f"No space left on the device while downloading {name!r} into {cache}: free "
            f"some space or choose another folder (--download-dir or HF_HUB_CACHE), then "
            f"{resume}."
        )
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"Could not download {name!r} from {endpoint} ({reason}): check the network, "
        f"HF_ENDPOINT and HF_TOKEN, then run it again; HF_HUB_OFFLINE=1 uses the cache only."
    )
