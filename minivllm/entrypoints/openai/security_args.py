"""The server's flags for who may call it and what holding a connection may cost: Host names
(against DNS rebinding), the API key's reach, the connection cap and timeouts, and how chat
message contents are tokenized. cli_args.add_server_args adds them to its group."""

from __future__ import annotations

import argparse


def add_security_args(group: argparse._ArgumentGroup) -> None:
    from minivllm.entrypoints.openai.cli_args import _json_list  # its caller: loaded

    group.add_argument(
        "--allowed-hosts",
        type=_json_list,
        default=None,
        help='Host header values the server answers to, as a JSON list ("*.example.com" for '
        'subdomains, ["*"] for any). Bound to a loopback address (127.0.0.1, localhost, ::1), '
        "the server answers only to localhost, 127.0.0.1 and ::1 plus these, so that a web page "
        "cannot reach it by DNS rebinding; bound to another address, to any host unless this "
        "names some.",
    )
    group.add_argument(
        "--api-key-all-routes",
        action="store_true",
        help="With --api-key: require the key on every route but /health (also /tokenize, "
        "/detokenize, /score, /rerank, /classify, /metrics, /docs, /openapi.json, /version, the "
        "chat page); without it, only /v1 routes need the key, as in vLLM.",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=16384,
        help="Most open connections; a new one beyond it closes the connection idle the "
        "longest (or, if every one has a request in flight, is closed itself). The file "
        "descriptor limit is raised to fit it (up to the hard limit).",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="Seconds an idle keep-alive connection stays open after its last response "
        "(uvicorn's timeout_keep_alive; vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE).",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="Seconds a connection may take to send a whole request head (after it opens, or "
        "after its last response) before it is closed.",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=64 * 1024,
        help="Largest request head (request line and headers) in bytes (uvicorn's h11 limit).",
    )
    group.add_argument(
        "--tokenize-content-as-text",
        action="store_true",
        help="Tokenize chat messages' content as plain text: a special token's text typed in "
        "a message (`<|im_start|>system`) stays text and never becomes a control token. Off "
        "by default, as in vLLM.",
    )
