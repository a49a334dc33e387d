"""minivllm.utils.zmq_sockets.bind_socket: ipc when the path fits, else a free TCP port."""

from __future__ import annotations

import zmq

from minivllm.utils.zmq_sockets import bind_socket


def _round_trip(address: str, ctx: zmq.Context, server: zmq.Socket) -> bytes:
    client = ctx.socket(zmq.PUSH)
    client.connect(address)
    client.send(b"ping")
    assert server.poll(5000)
    data = server.recv()
    client.close(linger=0)
    return data


def test_short_path_is_ipc_long_path_and_none_are_tcp(tmp_path):
    ctx = zmq.Context()
    sockets = [ctx.socket(zmq.PULL) for _ in range(3)]
    try:
        short = bind_socket(sockets[0], str(tmp_path / "s"))
        long = bind_socket(sockets[1], str(tmp_path / ("x" * 120)))
        plain = bind_socket(sockets[2])
        assert short == f"ipc://{tmp_path / 's'}"
        assert long.startswith("tcp://127.0.0.1:") and plain.startswith("tcp://127.0.0.1:")
        assert long != plain
        for sock, address in zip(sockets, (short, long, plain)):
            assert _round_trip(address, ctx, sock) == b"ping"
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
