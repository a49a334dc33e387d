"""Hub names download through the real ``huggingface_hub`` from a local fake Hub
(``HF_ENDPOINT``), each resolution in a fresh process (the library reads its variables
once, at import), and every failure is one line naming the model and what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.model.sources.fake_hub import FakeHub

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_opt):
    extra = tmp_path_factory.mktemp("extra")
    (extra / "README.md").write_text("a model card")
    (extra / "flax_model.msgpack").write_bytes(os.urandom(4096))
    (extra / "part1").write_bytes(b"GGUF" + os.urandom(2000))
    (extra / "part2").write_bytes(os.urandom(3000))
    (extra / "q8").write_bytes(b"GGUF" + os.urandom(100))
    (extra / "q4").write_bytes(b"GGUF" + os.urandom(25_000_000))  # two 10 MiB chunks and more
    opt = {name: os.path.join(tiny_opt, name) for name in os.listdir(tiny_opt)}
    opt.update(
        {
            "README.md": str(extra / "README.md"),
            "flax_model.msgpack": str(extra / "flax_model.msgpack"),
        }
    )
    server = FakeHub()
    server.add_repo("org/tiny-opt", opt)
    server.add_repo("facebook/opt-125m", opt)
    server.add_repo(
        "org/smol-GGUF",
        {
            "README.md": str(extra / "README.md"),
            "smol.Q4_1.gguf": str(extra / "q4"),
            "smol-Q8_0.gguf": str(extra / "q8"),
            "Q2_K/smol-Q2_K-00001-of-00002.gguf": str(extra / "part1"),
            "Q2_K/smol-Q2_K-00002-of-00002.gguf": str(extra / "part2"),
        },
    )
    server.add_repo("org/gated", {"config.json": os.path.join(tiny_opt, "config.json")})
    server.gated.add("org/gated")
    server.start()
    yield server
    server.stop()


def resolve(hub: FakeHub, cache, name: str, env: dict | None = None, patch: str = "", **kw):
    """resolve_model_source(name, **kw) in a fresh process: (path or None, error line)."""
    code = (
        "import sys, json\n"
        f"{patch}\n"
        "from minivllm.model.sources import resolve_model_source, ModelSourceError\n"
        "try:\n"
        f"    print(json.dumps(resolve_model_source({name!r}, **{kw!r})))\n"
        "except ModelSourceError as e:\n"
        "    print('ERROR ' + str(e))\n"
    )
    full_env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache)}
    full_env.pop("HF_HUB_OFFLINE", None)
    full_env.update(env or {})
    full_env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("ERROR ")]
    if errors:  # the message and whatever follows it: a one-line message has no "\n"
        return None, "\n".join(lines[errors[0] :])[len("ERROR ") :]
    return json.loads(lines[-1]), None


def test_a_checkpoint_downloads_what_loading_reads_once(hub, tmp_path):
    path, error = resolve(hub, tmp_path, "org/tiny-opt")
    assert error is None
    files = sorted(os.listdir(path))
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    assert "README.md" not in files and "flax_model.msgpack" not in files
    served = len(hub.requests)
    dead = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens: no network needed
    again, _ = resolve(hub, tmp_path, "org/tiny-opt", env=dead)
    assert again == path and len(hub.requests) == served  # the second start downloads nothing


def test_a_gguf_repo_gives_the_file_of_the_named_quantization(hub, tmp_path):
    path, error = resolve(hub, tmp_path, "org/smol-GGUF:Q4_1")
    assert error is None and path.endswith("smol.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    snapshot = os.path.dirname(path)
    assert "README.md" not in os.listdir(snapshot) and "smol-Q8_0.gguf" not in os.listdir(snapshot)
    path, _ = resolve(hub, tmp_path, "org/smol-GGUF:q8_0")  # case-insensitive
    assert path.endswith("smol-Q8_0.gguf")
    path, _ = resolve(hub, tmp_path, "org/smol-GGUF", hf_file="smol-Q8_0.gguf")
    assert path.endswith("smol-Q8_0.gguf")


def test_a_split_gguf_downloads_every_part_and_names_the_first(hub, tmp_path):
    path, error = resolve(hub, tmp_path, "org/smol-GGUF:Q2_K")
    assert error is None and path.endswith("smol-Q2_K-00001-of-00002.gguf")
    assert os.path.isfile(path.replace("00001-of", "00002-of"))


def test_a_choice_that_is_missing_or_ambiguous_lists_the_quantizations(hub, tmp_path):
    _, error = resolve(hub, tmp_path, "org/smol-GGUF:Q5_K_M")
    assert "org/smol-GGUF" in error and "Q4_1" in error and "Q8_0" in error
    _, error = resolve(hub, tmp_path, "org/smol-GGUF")
    assert "several GGUF quantizations" in error and "org/smol-GGUF:" in error


@pytest.mark.parametrize(
    "name, expected",
    [("org/missing", "was not found on the Hub"), ("org/gated", "is gated on the Hub")],
)
def test_missing_and_gated_repos_fail_in_one_line_naming_them(hub, tmp_path, name, expected):
    _, error = resolve(hub, tmp_path, name)
    assert expected in error and name in error and "\n" not in error
    assert "HF_TOKEN" in error


def test_offline_reads_the_cache_and_says_what_to_do_when_it_is_not_there(hub, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens
    _, error = resolve(hub, tmp_path, "org/tiny-opt", env=offline)
    assert "org/tiny-opt" in error and "HF_HUB_OFFLINE=1" in error and str(tmp_path) in error
    assert "\n" not in error
    path, _ = resolve(hub, tmp_path, "org/tiny-opt")
    assert resolve(hub, tmp_path, "org/tiny-opt", env=offline) == (path, None)
    resolve(hub, tmp_path, "org/smol-GGUF:Q8_0")
    path, error = resolve(hub, tmp_path, "org/smol-GGUF:Q8_0", env=offline)
    assert error is None and path.endswith("smol-Q8_0.gguf")


def test_a_cut_connection_resumes_where_it_stopped(hub, tmp_path):
    hub.cut_after[("org/smol-GGUF", "smol.Q4_1.gguf")] = (21_000_000, 2)  # cut twice
    path, error = resolve(hub, tmp_path, "org/smol-GGUF:Q4_1")
    assert error is None and os.path.getsize(path) == 25_000_004
    tries = [r for r in hub.requests if r.startswith("GET org/smol-GGUF/smol.Q4_1.gguf from")]
    assert int(tries[-1].rsplit(" ", 1)[1]) > 0  # the last request asked for the rest only


def test_a_download_cut_for_good_fails_in_one_line_and_the_next_run_resumes_it(hub, tmp_path):
    # huggingface_hub retries a cut transfer from where it stopped, then gives up; the
    # bytes it had stay on disk, and the next run asks for the rest only.
    key = ("org/smol-GGUF", "smol.Q4_1.gguf")
    hub.cut_after[key] = (21_000_000, 100)
    _, error = resolve(hub, tmp_path, "org/smol-GGUF:Q4_1")
    hub.cut_after.pop(key, None)
    assert "Could not download 'org/smol-GGUF:Q4_1'" in error and "\n" not in error
    served = len(hub.requests)
    path, error = resolve(hub, tmp_path, "org/smol-GGUF:Q4_1")
    assert error is None and os.path.getsize(path) == 25_000_004
    with open(path, "rb") as f, open(hub.repos[key[0]][key[1]], "rb") as original:
        assert f.read() == original.read()
    second_run = [r for r in hub.requests[served:] if r.startswith("GET org/smol-GGUF/smol.Q4_1")]
    assert len(second_run) == 1  # one request, for what the first run did not keep
    assert int(second_run[0].rsplit(" ", 1)[1]) >= 20 << 20  # (it writes 10 MiB chunks)
    blobs = os.listdir(os.path.dirname(os.path.realpath(path)))
    assert not [b for b in blobs if b.endswith(".incomplete")]


def test_a_full_disk_fails_in_one_line(hub, tmp_path):
    patch = (
        "import errno, huggingface_hub.file_download as fd\n"
        "def full(*a, **k):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "fd.http_get = full\n"
    )
    _, error = resolve(hub, tmp_path, "org/tiny-opt", patch=patch)
    assert "No space left" in error and "org/tiny-opt" in error and "--download-dir" in error
    assert "\n" not in error


def test_download_dir_is_the_cache_it_fills(hub, tmp_path):
    target = tmp_path / "models"
    path, _ = resolve(hub, tmp_path / "unused", "org/tiny-opt", download_dir=str(target))
    assert path.startswith(str(target))
    shutil.rmtree(target)
