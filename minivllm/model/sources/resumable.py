"""A Hub file fetched so that a cut download resumes on the next run.

``huggingface_hub`` (2.x) writes each download to a temporary file of its own process and
deletes it when the transfer fails, so a run that dies halfway leaves nothing: the next one
fetches the whole file again (a 4 GB GGUF on a flaky link may never finish). Here a file is
fetched into ``<cache>/models--org--name/blobs/<etag>.incomplete``, which stays when the
transfer fails; the next run asks for the rest only (an HTTP Range request, through
``huggingface_hub``'s own ``http_get``: its retries, progress bar and headers) and moves the
finished file to the blob's own name. ``hf_hub_download`` then finds the blob and only links
it into the snapshot, as for any cached file.

A file the Hub keeps in Xet storage is left to ``hf_hub_download`` where the ``hf_xet``
client is installed (it fetches by content chunks, not by byte ranges).
"""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlparse


def prefetch_blob(repo: str, filename: str, revision: str | None, cache_dir: str | None) -> None:
    """Fetch ``filename`` of ``repo`` into its cache blob, resuming a partial file an earlier
    run left. Raises what ``huggingface_hub`` raises (the caller turns it into one line)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo, filename, revision=revision)
    meta = get_hf_file_metadata(url, retry_on_errors=True)
    if meta.etag is None or (meta.xet_file_data is not None and _has_xet_client()):
        return  # hf_hub_download's own way (it refuses a file with no ETag itself)
    cache = cache_dir or constants.HF_HUB_CACHE
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blob = os.path.join(cache, folder, "blobs", meta.etag)
    if os.path.exists(blob):
        return
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    lock = os.path.join(cache, ".locks", folder, f"{meta.etag}.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    headers = build_hf_headers()
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address takes no Hub token
    partial = blob + ".incomplete"
    with WeakFileLock(lock):
        if os.path.exists(blob):  # another process finished it while this one waited
            return
        # not append mode: http_get seeks back to the start where a server ignores the range
        with open(partial, "r+b" if os.path.exists(partial) else "wb") as f:
            have = f.seek(0, os.SEEK_END)
            if meta.size is not None and have > meta.size:  # not this file's start: again
                have = f.seek(0)
                f.truncate()
            http_get(
                meta.location,
                f,
                resume_size=have,
                headers=headers,
                expected_size=meta.size,
                displayed_filename=filename,
            )
        os.replace(partial, blob)


def _has_xet_client() -> bool:
    return importlib.util.find_spec("hf_xet") is not None
