"""A link's goodput as ``iperf3`` measures it: the application bytes per second one bulk TCP
transfer moves, timed by the receiver from its first byte to its last. The shipped profiles'
link rates are such figures (iperf3 between the boards and their WiFi router), while a shaper
limits frames, headers included; pricing a shaped link at its goodput compares like with like.

Run as two processes, one on each end (``bench/pipeline_shaped.py`` starts them in its network
namespaces)::

    python bench/link_goodput.py serve HOST PORT up|down BYTES   # the hub's end
    python bench/link_goodput.py connect HOST PORT up|down BYTES  # the device's end

``up``: the device sends and the hub receives; ``down``: the other way. The receiving end prints
the goodput in bytes per second.
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 64 * 1024


def send(sock: socket.socket, nbytes: int) -> None:
    block = bytes(CHUNK)
    left = nbytes
    while left > 0:
        left -= sock.send(block[:min(CHUNK, left)])
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)   # wait until the receiver has read it all and closed


def receive(sock: socket.socket) -> float:
    """Bytes per second after the first read: the first read's bytes arrived before the clock
    started, so they are not counted."""
    first = sock.recv(CHUNK)
    t0, got = time.perf_counter(), 0
    while True:
        data = sock.recv(CHUNK)
        if not data:
            break
        got += len(data)
    elapsed = time.perf_counter() - t0
    sock.close()
    if not first or elapsed <= 0:
        raise SystemExit("link_goodput: nothing received")
    return got / elapsed


def main(argv: list[str]) -> None:
    role, host, port, direction, nbytes = argv[0], argv[1], int(argv[2]), argv[3], int(argv[4])
    if role == "serve":
        with socket.create_server((host, port)) as server:
            print("ready", flush=True)
            sock, _ = server.accept()
        receiving = direction == "up"
    else:
        sock = socket.create_connection((host, port), timeout=60)
        receiving = direction == "down"
    with sock:
        if receiving:
            print(f"{receive(sock):.1f}", flush=True)
        else:
            send(sock, nbytes)


if __name__ == "__main__":
    main(sys.argv[1:])
