"""A link's goodput as ``iperf3`` measures it: the application bytes per second one bulk TCP
transfer moves, timed by the receiver from its first byte to its last. The shipped profiles'
link rates are such figures (iperf3 between the boards and their WiFi router), while a shaper
limits frames, headers included; pricing a shaped link at its goodput compares like with like.

Run as two processes, one on each end (``bench/pipeline_shaped.py`` starts them in its network
namespaces)::

    python bench/link_goodput.py serve HOST PORT up|down BYTES   # the hub's end
    python bench/link_goodput.py connect HOST PORT up|down BYTES  # the device's end

``up``: the device sends and the hub receives; ``down``: the other way. The receiving end prints
the goodput in bytes per second. ``both``: each end sends ``BYTES`` while it receives the other's
over the one connection (as an agent's MQTT connection carries activations up while gradients
come down) and prints what it received per second: the hub the uplink's goodput, the device the
downlink's.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

CHUNK = 64 * 1024


def send(sock: socket.socket, nbytes: int) -> None:
    block = bytes(CHUNK)
    left = nbytes
    while left > 0:
        left -= sock.send(block[:min(CHUNK, left)])
    sock.shutdown(socket.SHUT_WR)


def both(sock: socket.socket, nbytes: int) -> float:
    """Send ``nbytes`` while receiving the other end's; the received goodput."""
    got: list[float] = []
    reader = threading.Thread(target=lambda: got.append(receive(sock, close=False)))
    reader.start()
    send(sock, nbytes)
    reader.join()
    sock.close()
    return got[0]


def receive(sock: socket.socket, close: bool = True) -> float:
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
    if close:
        sock.close()
    if not first or elapsed <= 0:
        raise SystemExit("link_goodput: nothing received")
    return got / elapsed


def main(argv: list[str]) -> None:
    role, host, port, direction, nbytes = argv[0], argv[1], int(argv[2]), argv[3], int(argv[4])
    if role == "serve":
        with socket.create_server((host, port)) as server:
            print(f"ready {server.getsockname()[1]}", flush=True)   # the port: 0 asks for a free one
            sock, _ = server.accept()
        receiving = direction == "up"
    else:
        sock = socket.create_connection((host, port), timeout=60)
        receiving = direction == "down"
    with sock:
        if direction == "both":
            print(f"{both(sock, nbytes):.1f}", flush=True)
        elif receiving:
            print(f"{receive(sock):.1f}", flush=True)
        else:
            send(sock, nbytes)
            sock.recv(1)   # wait until the receiver has read it all and closed


if __name__ == "__main__":
    main(sys.argv[1:])
