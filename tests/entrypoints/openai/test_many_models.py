"""A many-model server with real processes: a models folder holding the bundled GGUF under
two names, each model's engine core started by its first request; the least recently used
idle model unloaded to make room; doze and keep-alive; one core's death taking down only
its model; load and unload cycles leaving no process behind."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import psutil
import pytest

from tests.entrypoints.openai.utils import RemoteServer, metric, metrics, open_stream, request

GIB = 1 << 30
KV_GIB = 0.05
ENV = {"MINIVLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
BASE_ARGS = ["--max-model-len", "512", "--disable-log-stats"]


def _models_dir(tmp_path_factory, smollm2_path: str, names=("a", "b")) -> str:
    folder = tmp_path_factory.mktemp("models")
    for name in names:
        os.symlink(smollm2_path, folder / f"{name}.gguf")
    return str(folder)


def _get(server: RemoteServer, path: str) -> dict:
    status, _, body = request("GET", server.url_for(path))
    assert status == 200, body
    return json.loads(body)


def _post(server: RemoteServer, path: str, body: dict) -> tuple[int, dict, dict]:
    status, headers, data = request("POST", server.url_for(path), body)
    return status, headers, json.loads(data) if data else {}


def _states(server: RemoteServer) -> dict[str, str]:
    return {card["id"]: card["state"] for card in _get(server, "v1/models")["data"]}


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _complete(server: RemoteServer, model: str, max_tokens: int = 8) -> tuple[int, dict]:
    status, _, body = _post(
        server,
        "v1/completions",
        {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
         "temperature": 0},
    )  # fmt: skip
    return status, body


def _core_pids(server: RemoteServer) -> dict[str, int]:
    models = _get(server, "health")["models"]
    return {name: entry["pid"] for name, entry in models.items() if "pid" in entry}


def _tree_children(server: RemoteServer) -> set[int]:
    """The server's engine core processes (multiprocessing's resource tracker aside)."""
    pids = set()
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _embedding_folder(folder: str, tokenizer) -> None:
    """A tiny random embedding model's folder (a bare Qwen3Model: the pooling runner)."""
    from tests.conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint("qwen3", os.path.join(folder, "embedder"), tokenizer)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen3Model"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    """The bundled GGUF as a and b, and a tiny embedding model's folder."""
    folder = _models_dir(tmp_path_factory, smollm2_path)
    _embedding_folder(folder, smollm2_tokenizer)
    server = RemoteServer(["--models-dir", folder, *BASE_ARGS], env=ENV)
    yield server
    server.stop()


def test_models_are_listed_unloaded_until_asked(two_models, smollm2_path):
    assert _states(two_models) == {"a": "unloaded", "b": "unloaded", "embedder": "unloaded"}
    assert _get(two_models, "health")["models"] == {
        "a": {"state": "unloaded"},
        "b": {"state": "unloaded"},
        "embedder": {"state": "unloaded"},
    }
    assert _tree_children(two_models) == set()  # no engine core before a request
    # Ollama's list gives each model's size on disk, loaded or not (its memory was 0 then).
    sizes = {m["name"]: m["size"] for m in _get(two_models, "api/tags")["models"]}
    assert sizes["a"] == sizes["b"] == os.path.getsize(smollm2_path)
    assert sizes["embedder"] > 0
    assert _get(two_models, "api/ps")["models"] == []


def test_interleaved_requests_each_get_their_model(two_models):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda m: (m, *_complete(two_models, m)), ["a", "b", "a", "b"]))
    texts = {}
    for name, status, body in results:
        assert status == 200, body
        assert body["model"] == name
        texts.setdefault(name, set()).add(body["choices"][0]["text"])
    # One checkpoint under two names, greedy: every reply is the same text.
    assert len(texts["a"]) == 1 and texts["a"] == texts["b"]
    assert _states(two_models) == {"a": "loaded", "b": "loaded", "embedder": "unloaded"}
    pids = _core_pids(two_models)
    assert len(set(pids.values())) == 2
    samples = metrics(two_models)
    assert metric(samples, "minivllm:loaded_models") == 2
    for name in ("a", "b"):
        assert metric(samples, "vllm:request_success_total", model_name=name) >= 2


def test_an_embedding_model_answers_its_own_routes_beside_the_generative_ones(two_models):
    status, _, body = _post(two_models, "v1/embeddings", {"model": "embedder", "input": ["hi"]})
    assert status == 200, body
    assert body["model"] == "embedder" and len(body["data"][0]["embedding"]) == 64
    status, _, body = _post(two_models, "v1/embeddings", {"model": "a", "input": ["hi"]})
    assert status == 400 and "does not support" in body["error"]["message"]
    status, body = _complete(two_models, "embedder")
    assert status == 400 and "does not support" in body["error"]["message"]
    status, body = _complete(two_models, "a")
    assert status == 200, body


def test_unknown_and_missing_model_are_refused_without_loading(two_models):
    status, _, body = _post(two_models, "v1/chat/completions", {"model": "nope", "messages": []})
    assert status == 404 and "`nope` does not exist" in body["error"]["message"]
    status, _, body = _post(two_models, "v1/completions", {"prompt": "hi"})
    assert status == 400 and "`model` is required" in body["error"]["message"]
    status, _, body = _post(two_models, "api/generate", {"model": "nope", "prompt": "hi"})
    assert status == 404 and "does not exist" in body["error"]  # Ollama's error shape
    # A name UTF-8 cannot carry (a lone surrogate, valid JSON) is quoted escaped in each
    # API's shape: before, writing the error failed as a 500.
    for path in ("v1/completions", "v1/messages", "api/chat", "models/load"):
        status, _, body = _post(two_models, path, {"model": "\ud800", "prompt": "hi"})
        message = body["error"] if path.startswith("api/") else body["error"]["message"]
        assert status == 404 and "`\ud800` does not exist" in message, (path, body)


def test_a_killed_engine_core_takes_down_only_its_model(two_models):
    pids = _core_pids(two_models)
    conn = open_stream(
        two_models,
        "/v1/completions",
        {"model": "a", "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "stream": True,
         "ignore_eos": True, "temperature": 0},
    )  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the stream runs
    os.kill(pids["a"], signal.SIGKILL)
    killed_at = time.monotonic()
    rest = response.read().decode()
    assert '"error"' in rest  # the stream ends with an error event
    assert time.monotonic() - killed_at < 10  # 2 s unloaded; a busy test machine is slower
    conn.close()
    status, body = _complete(two_models, "b")  # the other model serves on
    assert status == 200, body
    health = _get(two_models, "health")["models"]
    assert health["a"]["state"] == "failed" and "dead" in health["a"]["error"]
    assert health["b"]["state"] == "loaded"
    status, body = _complete(two_models, "a")  # the next request starts it again
    assert status == 200, body
    new_pids = _core_pids(two_models)
    assert new_pids["a"] != pids["a"] and new_pids["b"] == pids["b"]


def test_ollama_keep_alive_zero_unloads_after_the_request(two_models):
    pid = _core_pids(two_models)["b"]
    status, _, body = _post(
        two_models,
        "api/generate",
        {"model": "b", "prompt": "hi", "stream": False, "keep_alive": 0,
         "options": {"num_predict": 4}},
    )  # fmt: skip
    assert status == 200 and body["done"], body
    _wait_for(lambda: _states(two_models)["b"] == "unloaded", "b unloaded")
    _wait_for(lambda: not psutil.pid_exists(pid), "b's engine core to exit", 15)


@pytest.mark.slow  # ~20 s: two engine starts
def test_load_and_unload_cycles_leave_no_process(two_models):
    for name in _states(two_models):
        _post(two_models, "models/unload", {"model": name})
    _wait_for(lambda: not _tree_children(two_models), "no engine core", 15)
    for _ in range(2):
        status, _, body = _post(two_models, "models/load", {"model": "a"})
        assert status == 200 and body["state"] == "loaded", body
        assert len(_tree_children(two_models)) >= 1
        status, _, body = _post(two_models, "models/unload", {"model": "a"})
        assert status == 200 and body["state"] == "unloaded", body
        _wait_for(lambda: not _tree_children(two_models), "no engine core", 15)


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory, smollm2_path):
    """A budget that fits one of the two models (each: its weights and the KV cache), and a
    third model (a sparse file of 64 GiB) that can never fit."""
    folder = _models_dir(tmp_path_factory, smollm2_path)
    with open(os.path.join(folder, "huge.gguf"), "wb") as f:
        f.truncate(64 * GIB)
    with open(os.path.join(folder, "broken.gguf"), "wb") as f:
        f.write(b"GGUF but not really")
    one = os.path.getsize(smollm2_path) + KV_GIB * GIB
    budget_gib = 1.5 * one / GIB
    server = RemoteServer(
        ["--models-dir", folder, "--models-memory", f"{budget_gib:.3f}",
         "--max-queued-per-model", "1", "--max-model-restarts", "2", *BASE_ARGS],
        env=ENV,
    )  # fmt: skip
    server.budget = budget_gib * GIB
    yield server
    server.stop()


def test_a_request_past_the_load_queue_gets_a_503_with_retry_after(budget_server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_complete, budget_server, "a")
        _wait_for(lambda: _states(budget_server)["a"] == "loading", "a's load to start", 15)
        status, headers, body = _post(
            budget_server, "v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 1}
        )
        assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers)
        assert "1 requests already wait" in body["error"]["message"]
        assert first.result()[0] == 200  # the one in the queue is answered once a loads


def test_a_model_that_does_not_fit_unloads_the_least_recently_used(budget_server):
    status, body = _complete(budget_server, "a")
    assert status == 200, body
    assert _states(budget_server)["a"] == "loaded"
    status, body = _complete(budget_server, "b")
    assert status == 200, body
    states = _states(budget_server)
    assert (states["a"], states["b"], states["huge"]) == ("unloaded", "loaded", "unloaded")
    cards = {c["id"]: c for c in _get(budget_server, "v1/models")["data"]}
    assert cards["b"]["memory_bytes"] <= budget_server.budget
    # The engine cores hold their model and cache within the budget, besides each process's
    # own runtime (Python, torch): a generous margin for that.
    cores = [psutil.Process(pid) for pid in _core_pids(budget_server).values()]
    assert len(cores) == 1
    rss = sum(p.memory_info().rss for p in cores)
    assert rss < budget_server.budget + 1.5 * GIB


def test_a_model_that_can_never_fit_is_a_400_naming_the_numbers(budget_server):
    status, body = _complete(budget_server, "huge")
    assert status == 400
    message = body["error"]["message"]
    assert "`huge` needs about 64.05 GiB" in message and "--models-memory" in message
    assert _states(budget_server)["huge"] == "unloaded"


@pytest.fixture(scope="module")
def dozing_server(smollm2_path):
    server = RemoteServer(
        ["--model", f"m={smollm2_path}", "--keep-alive", "1", "--doze-window", "2", *BASE_ARGS],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.1"},
    )
    yield server
    server.stop()


def _fill_kv_cache(server: RemoteServer, model: str) -> None:
    """Prompts that together write most of the 0.1 GiB cache (46 kB a token): a block's
    pages are resident once written, and not before."""

    def one(i: int):
        status, _, body = _post(
            server,
            "v1/completions",
            {"model": model, "prompt": f"{i} " + "word " * 440, "max_tokens": 1},
        )
        assert status == 200, body

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        list(pool.map(one, range(5)))


def test_an_idle_model_dozes_without_its_kv_cache_then_unloads(dozing_server):
    _fill_kv_cache(dozing_server, "m")
    pid = _core_pids(dozing_server)["m"]
    awake_rss = psutil.Process(pid).memory_info().rss
    _wait_for(lambda: _states(dozing_server)["m"] == "dozing", "the model to doze", 15)
    time.sleep(0.3)
    dozing_rss = psutil.Process(pid).memory_info().rss
    # The cache's written pages are let go; the weights stay.
    assert awake_rss - dozing_rss > 0.05 * GIB, (awake_rss, dozing_rss)
    status, body = _complete(dozing_server, "m")  # wakes it: the same process answers
    assert status == 200, body
    assert _core_pids(dozing_server)["m"] == pid
    assert _states(dozing_server)["m"] == "loaded"
    _wait_for(lambda: _states(dozing_server)["m"] == "dozing", "the model to doze again", 15)
    _wait_for(lambda: _states(dozing_server)["m"] == "unloaded", "the model to unload", 20)
    _wait_for(lambda: not psutil.pid_exists(pid), "the engine core to exit", 15)


def test_a_model_that_keeps_failing_to_start_stays_down_with_its_error(budget_server):
    for _ in range(2):
        status, body = _complete(budget_server, "broken")
        assert status == 503 and "`broken` failed to start" in body["error"]["message"]
    status, body = _complete(budget_server, "broken")  # no third start
    assert status == 503 and "down after 2 failed starts" in body["error"]["message"]
    health = _get(budget_server, "health")["models"]["broken"]
    assert health["state"] == "failed" and health["error"]
    assert _states(budget_server)["b"] == "loaded"  # the others are untouched
    assert len(_tree_children(budget_server)) == 1  # no core left from the failed starts
