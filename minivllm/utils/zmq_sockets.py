"""Binding a ZeroMQ socket: ipc where a short path is given, else a free TCP port."""

from __future__ import annotations

import zmq

LOCALHOST = "127.0.0.1"
# sockaddr_un holds 107 bytes; a longer ipc path would be cut.
_MAX_IPC_PATH = 100


def bind_socket(sock: zmq.Socket, ipc_path: str | None = None, host: str = LOCALHOST) -> str:
    """Bind ``sock`` and return the address peers connect to: ``ipc://ipc_path`` when the
    path is given and short enough, else a random free port on ``host``."""
    if ipc_path is not None and len(ipc_path) < _MAX_IPC_PATH:
        address = f"ipc://{ipc_path}"
        sock.bind(address)
        return address
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
