"""Real clients against `minivllm serve` on the bundled model (issue 51, acceptance 1, 2 and
4): lm-evaluation-harness's `local-completions` (a log-likelihood task and a generate_until
task, its tokenizer read through /tokenizer_info; per-item log-likelihoods equal to its `hf`
backend's on the same float32 weights), the OpenAI Agents SDK running an agent
with one function tool, and the Codex and Claude Code CLIs completing a turn. Each is slow
(a client process, thousands of prompt tokens) and skipped where its client is not
installed (README, "Clients", says how to install and run each). The tiny model's answers
do not matter here; the protocol does: every turn must complete without a protocol error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.entrypoints.openai.utils import RemoteServer, post_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm"
# Coding agents send thousands of tokens of instructions and tool definitions: the bundled
# model's whole context.
MAX_MODEL_LEN = 8192
CLIENT_TIMEOUT_S = 600
# Where the npm clients are looked for besides PATH (README: npm install --prefix there).
NPM_PREFIX = os.environ.get("MINIVLLM_NPM_PREFIX", "/tmp/minivllm-clients")


def npm_bin(name: str) -> str | None:
    local = os.path.join(NPM_PREFIX, "node_modules", ".bin", name)
    return local if os.path.exists(local) else shutil.which(name)


@pytest.fixture(scope="module")
def agent_server():
    remote = RemoteServer(
        # Greedy where a client sets no temperature (Codex, Claude Code): the same turn
        # every run, not a sampled one that may ramble to the end of the context.
        ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
         "--enable-tokenizer-info-endpoint",
         "--override-generation-config", '{"temperature": 0}'],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    yield remote
    remote.stop()


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
    done = subprocess.run(
        cmd,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return done


# ---------------------------------------------------------------------------- lm-eval

CAPITALS = [
    ("France", "Paris", ["Paris", "Rome", "Berlin"]),
    ("Italy", "Rome", ["Madrid", "Rome", "Oslo"]),
    ("Germany", "Berlin", ["Berlin", "Vienna", "Lisbon"]),
    ("Spain", "Madrid", ["Athens", "Dublin", "Madrid"]),
]


def write_tasks(folder) -> None:
    """Two tasks on local data (no dataset hub): multiple choice (log-likelihoods) and
    generate_until; written as JSON, which YAML reads."""
    data = folder / "capitals.jsonl"
    with open(data, "w") as f:
        for country, capital, choices in CAPITALS:
            row = {"country": country, "capital": capital, "choices": choices,
                   "answer": choices.index(capital)}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    common = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
    }
    tasks = {
        "capitals_mc": {
            "output_type": "multiple_choice",
            "doc_to_text": "The capital of {{country}} is",
            "doc_to_choice": "choices",
            "doc_to_target": "answer",
            "metric_list": [{"metric": "acc"}],
        },
        "capitals_gen": {
            "output_type": "generate_until",
            "doc_to_text": "Q: What is the capital of {{country}}?\nA:",
            "doc_to_target": " {{capital}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for name, task in tasks.items():
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, **common, **task}))


def test_lm_eval_local_completions(agent_server, tmp_path):
    pytest.importorskip("lm_eval")
    tasks, out = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    write_tasks(tasks)
    model_args = (
        f"base_url={agent_server.url_for('v1', 'completions')},model={MODEL},"
        "num_concurrent=1,max_retries=1,timeout=300"
    )
    done = run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions",
         "--model_args", model_args, "--tasks", "capitals_mc,capitals_gen",
         "--include_path", str(tasks), "--limit", str(len(CAPITALS)),
         "--output_path", str(out), "--log_samples"],
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "remote tokenizer" in log.lower(), log[-4000:]  # through /tokenizer_info
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["capitals_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["capitals_gen"]["exact_match,none"] <= 1.0
    # Each choice's log-likelihood is the server's own score of the same tokens.
    samples = [json.loads(line) for line in next(out.rglob("samples_capitals_mc_*.jsonl")).open()]
    assert len(samples) == len(CAPITALS)
    sample = samples[0]
    context = sample["arguments"]["gen_args_0"]["arg_0"]
    for i, choice in enumerate(CAPITALS[sample["doc_id"]][2]):
        loglikelihood = float(sample["resps"][i][0][0])
        assert loglikelihood == pytest.approx(score(agent_server, context, " " + choice), abs=1e-4)


def lm_eval_loglikelihoods(model: str, model_args: str, tasks, out, *extra: str) -> dict:
    """Run lm-eval's capitals_mc task on a backend; each (doc, choice) to its log-likelihood."""
    done = run(
        [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
         "--tasks", "capitals_mc", "--include_path", str(tasks), "--limit", str(len(CAPITALS)),
         "--output_path", str(out), "--log_samples", *extra],
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    samples = [json.loads(line) for line in next(out.rglob("samples_capitals_mc_*.jsonl")).open()]
    assert len(samples) == len(CAPITALS)
    return {
        (s["doc_id"], i): float(resp[0][0]) for s in samples for i, resp in enumerate(s["resps"])
    }


def test_lm_eval_per_item_loglikelihoods_equal_its_hf_backend(tmp_path):
    """Acceptance 4: the bundled GGUF served dequantized (no tokenizer folder: lm-eval reads
    the tokenizer through /tokenizer_info) gives lm-eval the per-item log-likelihoods its
    own `hf` backend computes on the same float32 weights, within 1e-4."""
    pytest.importorskip("lm_eval")
    from benchmarks.prepare_model import prepare

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    hf_dir = prepare(str(tmp_path / "fp32"))
    server = RemoteServer(
        ["--quantization", "none", "--max-model-len", "512", "--served-model-name", MODEL,
         "--enable-tokenizer-info-endpoint"],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.25"},
    )  # fmt: skip
    try:
        model_args = (
            f"base_url={server.url_for('v1', 'completions')},model={MODEL},"
            "num_concurrent=1,max_retries=1,timeout=300"
        )
        served = lm_eval_loglikelihoods("local-completions", model_args, tasks, tmp_path / "served")
    finally:
        server.stop()
    reference = lm_eval_loglikelihoods(
        "hf", f"pretrained={hf_dir},dtype=float32", tasks, tmp_path / "hf", "--device", "cpu"
    )  # fmt: skip
    assert served.keys() == reference.keys()
    for key, value in reference.items():
        assert served[key] == pytest.approx(value, abs=1e-4), key


def score(server, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, split as lm-eval splits it (the
    whole text's ids after the context's), from an echo with max_tokens 0."""

    def ids(text: str) -> list[int]:
        status, body = post_json(
            server.url_for("tokenize"), {"prompt": text, "add_special_tokens": False}
        )
        assert status == 200, body
        return body["tokens"]

    whole, num_context = ids(context + continuation), len(ids(context))
    status, body = post_json(
        server.url_for("v1", "completions"),
        {"model": MODEL, "prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 1},
    )
    assert status == 200, body
    return sum(body["choices"][0]["logprobs"]["token_logprobs"][num_context:])


# ---------------------------------------------------------------------------- Agents SDK


def agent_with_tool(agents, server, tool, instructions: str, **settings):
    """An agent on the SDK's default model (the Responses API) at this server. The tiny
    model would not choose the tool by itself: the first turn must call it, once (it would
    go on adding calls to the list); the SDK resets tool_choice after it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
    agents.set_tracing_disabled(True)
    model_settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0
    )
    agent = agents.Agent(
        name="agent",
        instructions=instructions,
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[tool],
        model_settings=model_settings,
        **settings,
    )
    return agent, client


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(agent_server):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    agent, _ = agent_with_tool(agents, agent_server, get_weather, "Answer with the tool.")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    # The call, its output sent back (function_call_output), then a text answer.
    assert len(calls) == 1
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


def test_openai_agents_sdk_streams_the_call(agent_server):
    agents = pytest.importorskip("agents")
    import asyncio

    @agents.function_tool
    def shout(text: str) -> str:
        """The text in capitals."""
        return text.upper() + "!"

    # The tool's answer is the agent's (the SDK fails a stream that ends incomplete, and the
    # tiny model's text turn could run to max_tokens).
    agent, client = agent_with_tool(
        agents, agent_server, shout, "Shout with the tool.", tool_use_behavior="stop_on_first_tool"
    )

    async def go():
        result = agents.Runner.run_streamed(agent, "Shout hello.", max_turns=3)
        events = [event.type async for event in result.stream_events()]
        await client.close()
        return result, events

    result, events = asyncio.run(go())
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    assert "raw_response_event" in events
    assert isinstance(result.final_output, str) and result.final_output.endswith("!")


# ---------------------------------------------------------------------------- Codex CLI


# Codex's own instructions (4,300 tokens) are kept; what it adds about permissions, apps and
# the environment is left out, so that the tiny model's answer ends sooner.
CODEX_SHORTER_PROMPT = [
    "-c", "include_permissions_instructions=false", "-c", "include_apps_instructions=false",
    "-c", "include_environment_context=false", "-c", "web_search=disabled",
]  # fmt: skip


def test_codex_exec_completes_a_turn(agent_server, tmp_path):
    codex = npm_bin("codex")
    if codex is None:
        pytest.skip("the Codex CLI is not installed (README: Clients)")
    home = tmp_path / "codex-home"
    home.mkdir()
    provider = (
        f'{{name="minivllm", base_url="{agent_server.url_for("v1")}", '
        'wire_api="responses", env_key="MINIVLLM_API_KEY"}'
    )
    done = run(
        [codex, "exec", "--skip-git-repo-check", "-m", MODEL,
         "-c", "model_provider=minivllm", "-c", f"model_providers.minivllm={provider}",
         *CODEX_SHORTER_PROMPT, "Say hello."],
        env={"CODEX_HOME": str(home), "MINIVLLM_API_KEY": "none"},
        cwd=str(tmp_path),
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "ERROR" not in log, log[-4000:]


# ---------------------------------------------------------------------------- Claude Code


# Claude Code's cap on a reply: the tiny model's reply under Claude Code's 3,000-token system
# prompt seldom ends by itself (greedy: 6,500 tokens, until the context is full), which
# takes minutes here; past the cap Claude Code stops with its own message.
CLAUDE_MAX_OUTPUT_TOKENS = 64


def run_claude(server, tmp_path, *args: str):
    claude = npm_bin("claude")
    if claude is None:
        pytest.skip("Claude Code is not installed (README: Clients)")
    return run(
        [claude, "-p", "Say hello.", "--model", MODEL, "--max-turns", "2", *args],
        env={
            "ANTHROPIC_BASE_URL": server.url_root,
            "ANTHROPIC_API_KEY": "none",
            # Every model Claude Code picks for a side task is the served one.
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_MAX_OUTPUT_TOKENS),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "HOME": str(tmp_path),
        },
        cwd=str(tmp_path),
    )


def test_claude_code_print_mode_completes_a_turn(agent_server, tmp_path):
    """claude -p with its own agent prompt (~24 tools) through the Messages API (streamed):
    exit 0 where the model ends its reply, or Claude Code's own "exceeded the output token
    maximum" where the tiny model does not (a whole, well-formed stream that ended with
    stop_reason max_tokens); any API error fails."""
    done = run_claude(agent_server, tmp_path)
    log = done.stdout + done.stderr
    capped = f"exceeded the {CLAUDE_MAX_OUTPUT_TOKENS} output token maximum" in log
    assert done.returncode == 0 or capped, log[-4000:]
    assert capped or "API Error" not in log, log[-4000:]
    assert not re.search(r"API Error: [45]\d\d", log), log[-4000:]


def test_claude_code_print_mode_exits_0_with_a_small_models_prompt(agent_server, tmp_path):
    """Acceptance 2 as README gives it for a small model: Claude Code's agent prompt and
    tools replaced by a one-line system prompt, the turn ends with the model's own reply
    and exit 0."""
    done = run_claude(
        agent_server, tmp_path, "--system-prompt", "You are a helpful assistant. Answer in "
        "one short sentence.", "--tools", "",
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert done.stdout.strip(), log[-4000:]
    assert "API Error" not in log, log[-4000:]
