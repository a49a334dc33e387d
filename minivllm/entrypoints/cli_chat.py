"""`minivllm chat` and `minivllm complete`: terminal clients of a running server (vLLM's
`vllm chat` / `vllm complete`).

`chat` keeps the conversation and sends it whole with each turn to /v1/chat/completions;
`complete` sends each line on its own to /v1/completions. Answers stream as they are
written. Ctrl-C during an answer stops it (the connection is closed, so the server aborts
the request) and returns to the prompt; Ctrl-C or Ctrl-D at the prompt quits.
`--quick MESSAGE` answers once and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx

from minivllm import envs

DEFAULT_URL = "http://localhost:8000/v1"
PROMPT = "> "
# Connecting and the first byte may wait for a busy engine; the answer itself may be long.
TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=10.0)


class ServerError(Exception):
    """The server answered with an error (its OpenAI-style message), or could not be reached."""


def api_base(url: str) -> str:
    """The API root: the URL as given, with /v1 added when it has no path at all."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


class Client:
    """A streaming client of the OpenAI-compatible API, on httpx (a dependency already)."""

    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=api_base(url), headers=headers, timeout=TIMEOUT)
        self.model = model or self.first_model()

    def first_model(self) -> str:
        body = self._checked(self._send("GET", "/models")).json()
        if not body.get("data"):
            raise ServerError("the server serves no model")
        return body["data"][0]["id"]

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.http.base_url}: {exc}") from exc

    @staticmethod
    def _checked(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        response.read()
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text or response.reason_phrase
        raise ServerError(f"{response.status_code}: {message}")

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict]:
        """The parsed `data:` events of a streamed response; closing it closes the
        connection, which makes the server abort the request."""
        body = {"model": self.model, "stream": True, **body}
        try:
            with self.http.stream("POST", path, json=body) as response:
                self._checked(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ServerError(event["error"].get("message", str(event["error"])))
                    yield event
        except httpx.HTTPError as exc:
            raise ServerError(f"the stream broke: {exc}") from exc

    def close(self) -> None:
        self.http.close()


def _chat_deltas(client: Client, messages: list[dict], params: dict) -> Iterator[str]:
    for event in client.stream("/chat/completions", {"messages": messages, **params}):
        for choice in event.get("choices", []):
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield text


def _completion_deltas(client: Client, prompt: str, params: dict) -> Iterator[str]:
    for event in client.stream("/completions", {"prompt": prompt, **params}):
        for choice in event.get("choices", []):
            if choice.get("text"):
                yield choice["text"]


def write_answer(deltas: Iterator[str], out: TextIO) -> tuple[str, bool]:
    """Print the answer as it streams in; (the text written, whether it ran to its end).

    Ctrl-C stops it: the stream is closed (the server aborts the request) and the text so
    far is kept.
    """
    parts: list[str] = []
    try:
        for text in deltas:
            parts.append(text)
            out.write(text)
            out.flush()
    except KeyboardInterrupt:
        deltas.close()
        out.write("\n[stopped]\n")
        out.flush()
        return "".join(parts), False
    out.write("\n")
    out.flush()
    return "".join(parts), True


def read_line(prompt: str) -> str | None:
    """One line from the user; None when they quit (Ctrl-D, or Ctrl-C at the prompt)."""
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        print()
        return None


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.extra_body:
        params.update(json.loads(args.extra_body))
    return params


def chat_params(args: argparse.Namespace) -> dict[str, Any]:
    """A chat turn's fields: a person waits on it, so it is latency-sensitive (the server's
    slo policy meets its default targets); --extra-body may say otherwise."""
    return {"is_latency_sensitive": True, **sampling_params(args)}


def run_chat(args: argparse.Namespace) -> None:
    """`minivllm chat`: a conversation, kept and sent whole with each turn."""
    client = _connect(args)
    params = chat_params(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})

    def turn(text: str) -> bool:
        messages.append({"role": "user", "content": text})
        try:
            answer, _ = write_answer(_chat_deltas(client, messages, params), sys.stdout)
        except ServerError as exc:
            messages.pop()  # the server never saw this turn: keep the history as it was
            print(f"error: {exc}", file=sys.stderr)
            return False
        # A stopped answer stays in the history as far as it was written.
        messages.append({"role": "assistant", "content": answer})
        return True

    try:
        if args.quick is not None:
            sys.exit(0 if turn(args.quick) else 1)
        print(f"Chatting with {client.model}. Ctrl-C stops an answer; Ctrl-D quits.")
        while (line := read_line(PROMPT)) is not None:
            if line.strip():
                turn(line)
    finally:
        client.close()


def run_complete(args: argparse.Namespace) -> None:
    """`minivllm complete`: each line is a prompt, continued by the model."""
    client = _connect(args)
    params = sampling_params(args)

    def complete(prompt: str) -> bool:
        try:
            write_answer(_completion_deltas(client, prompt, params), sys.stdout)
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return False
        return True

    try:
        if args.quick is not None:
            sys.exit(0 if complete(args.quick) else 1)
        print(f"Completing with {client.model}. Ctrl-C stops an answer; Ctrl-D quits.")
        while (line := read_line(PROMPT)) is not None:
            if line:
                complete(line)
    finally:
        client.close()


def _connect(args: argparse.Namespace) -> Client:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    try:
        return Client(args.url, args.api_key, args.model_name)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help="The server's API root (/v1 is added to a bare host)."
    )
    parser.add_argument(
        "--api-key",
        default=envs.MINIVLLM_API_KEY or os.environ.get("OPENAI_API_KEY"),
        help="The server's --api-key. Default: $MINIVLLM_API_KEY, else $OPENAI_API_KEY.",
    )
    parser.add_argument(
        "--model-name",
        "--model",
        dest="model_name",
        default=None,
        help="The model to ask. Default: the first one /v1/models lists.",
    )
    parser.add_argument(
        "-q",
        "--quick",
        metavar="MESSAGE",
        default=None,
        help="Send MESSAGE, print the answer and exit.",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="Most tokens per answer.")
    parser.add_argument("--temperature", type=float, default=None, help="Sampling temperature.")
    parser.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="Extra request fields, as a JSON object, e.g. '{\"top_k\": 40}'.",
    )


def register(subparsers) -> None:
    """Add `chat` and `complete` to the `minivllm` command."""
    chat = subparsers.add_parser(
        "chat",
        help="Chat with a running server in the terminal.",
        description="An interactive chat with a running `minivllm serve` (or any "
        "OpenAI-compatible server); the conversation is kept.",
    )
    _add_client_args(chat)
    chat.add_argument("--system-prompt", default=None, help="A system message to start with.")
    chat.set_defaults(dispatch=run_chat)
    complete = subparsers.add_parser(
        "complete",
        help="Complete prompts with a running server in the terminal.",
        description="Each line typed is a prompt that a running `minivllm serve` continues.",
    )
    _add_client_args(complete)
    complete.set_defaults(dispatch=run_complete)
