"""A device that lies, written from docs/protocol.md alone (paho-mqtt, msgpack, numpy, zstandard;
nothing of this package): it joins a run as an agent with valid credentials would, then sends
activations of the assigned shape but a hundred times the size of anyone's, random labels, and
at the end of each round the weights it received plus noise. Every message is well formed: only
what it says is false.

    python tests/liar_agent.py --broker mqtt://127.0.0.1:1883 --run R --agent-id liar --index 4

It handles what a short test run needs (whole messages, no chunks; lock-step; no labels
withheld) and exits at ``shutdown`` or after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import secrets
import sys
import threading
import time
from urllib.parse import urlparse

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import zstandard

DTYPES = {"float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "uint8": "u1"}
_seq = 0


def next_seq() -> int:
    """§3: max(previous + 1, the wall clock in nanoseconds)."""
    global _seq
    _seq = max(_seq + 1, time.time_ns())
    return _seq


def envelope(kind: str, run: str, sender: str, body: dict, rnd: int = 0, step: int = 0) -> bytes:
    return msgpack.packb({"v": 2, "type": kind, "run": run, "sender": sender, "seq": next_seq(),
                          "round": rnd, "step": step, "body": body}, use_bin_type=True)


def tensor(a: np.ndarray, dtype: str) -> dict:
    """§4.1: a plain tensor map, raw little-endian bytes, not compressed."""
    return {"dtype": dtype, "shape": list(a.shape), "z": False, "data": np.ascontiguousarray(a.astype(DTYPES[dtype])).tobytes()}


def decode(t: dict) -> np.ndarray:
    data = zstandard.ZstdDecompressor().decompress(t["data"], max_output_size=64 << 20) if t["z"] else t["data"]
    return np.frombuffer(data, dtype=DTYPES[t["dtype"]]).reshape(t["shape"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--agent-id", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--scale", type=float, default=100.0, help="the activations' size against an honest device's")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    run, me = args.run, args.agent_id
    url = urlparse(args.broker)
    instance = secrets.token_hex(6)
    inbox: queue.Queue = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sfl-{run}-{me}-{instance[:6]}",
                         clean_session=True)
    client.will_set(f"sfl/{run}/status/{me}", envelope("status", run, me, {"online": False, "instance": instance}),
                    qos=1, retain=True)

    def on_connect(c, _userdata, _flags, _rc, _props=None):
        c.subscribe([(f"sfl/{run}/down/{me}", 1), (f"sfl/{run}/info", 1)])
        c.publish(f"sfl/{run}/status/{me}", envelope("status", run, me, {"online": True, "instance": instance}),
                  qos=1, retain=True)

    client.on_connect = on_connect
    client.on_message = lambda _c, _u, m: inbox.put(m.payload) if m.payload else None
    client.connect(url.hostname, url.port or 1883, keepalive=15)
    client.loop_start()
    up = f"sfl/{run}/up/{me}"

    def send(kind: str, body: dict, rnd: int = 0, step: int = 0) -> bytes:
        payload = envelope(kind, run, me, body, rnd, step)
        client.publish(up, payload, qos=1)
        return payload

    registered = threading.Event()
    stop = threading.Event()
    last_round = [0]

    def heartbeat() -> None:    # §7.3: the liveness signal, every 2 s
        while not stop.wait(2.0):
            if registered.is_set():
                send("heartbeat", {"state": "idle"}, last_round[0])

    threading.Thread(target=heartbeat, daemon=True).start()
    info = None
    assign: dict = {}
    assign_seq, done = -1, -1   # the assignment followed, the last step answered
    last: bytes = b""
    rng = np.random.default_rng(args.index)
    deadline = time.monotonic() + args.timeout

    def activations(rnd: int, step: int) -> bytes:
        shape = [assign["batch_size"], *assign["activation_shape"]]
        x = rng.standard_normal(shape) * args.scale
        y = rng.integers(0, info["num_classes"], assign["batch_size"])
        return send("activations", {"x": tensor(x, "float32"), "y": tensor(y, "int64"), "compute_s": 0.001}, rnd, step)

    while time.monotonic() < deadline:
        try:
            raw = inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if "chunk" in msg:
            raise SystemExit("liar_agent: chunked messages are not handled")
        kind, body, rnd, step = msg["type"], msg["body"], msg["round"], msg["step"]
        if kind == "run_info" and info is None:
            info = body
            send("probe", {"nonce": random.getrandbits(48), "pad": b"\0" * 64, "reply_bytes": 64})
        elif kind == "probe_ack" and not registered.is_set():
            counts = [20] * info["num_classes"]
            send("register", {
                "index": args.index,
                "profile": {"name": "liar", "compute_flops": 5e9, "link_bytes_per_s": 2.5e6,
                            "downlink_bytes_per_s": 2.5e6, "latency_s": 0.01},
                "measured": {"compute_s_per_sample": {str(s): 1e-4 for s in info["splits"]}, "rtt_s": 0.001,
                             "up_bytes_per_s": 1e8, "down_bytes_per_s": 1e8},
                "label_counts": counts, "num_samples": sum(counts), "emulate": False,
                "resume": {"rounds_done": 0}, "instance": instance})
        elif kind == "accepted":
            registered.set()
        elif kind == "reject":
            print(f"liar_agent: rejected: {body['reason']}", file=sys.stderr)
            return 1
        elif kind == "assign":
            if msg["seq"] == assign_seq or rnd < last_round[0]:
                client.publish(up, last, qos=1)     # §7.1: a duplicate: the last reply again
                continue
            assign, assign_seq, last_round[0], done = body, msg["seq"], rnd, -1
            last = activations(rnd, 0)
        elif kind == "gradients":
            if rnd != last_round[0] or step <= done:
                client.publish(up, last, qos=1)     # §7.1: applied already: the last reply again
                continue
            done = step
            if step + 1 < assign["tau"]:
                last = activations(rnd, step + 1)
            else:   # the weights it received, plus noise as large as themselves
                weights = {}
                for key, t in assign["weights"].items():
                    if t["dtype"] in ("float32", "float16"):
                        w = decode(t).astype(np.float64)
                        weights[key] = tensor(w + rng.standard_normal(w.shape) * (np.abs(w).mean() + 1e-3), "float32")
                    else:
                        weights[key] = t
                last = send("weights", {"weights": weights, "num_samples": 200, "compute_s": 0.01,
                                        "loss": float("nan")}, rnd, assign["tau"] - 1)
        elif kind == "shutdown":
            break
    stop.set()
    client.publish(f"sfl/{run}/status/{me}", envelope("status", run, me, {"online": False, "instance": instance}),
                   qos=1, retain=True).wait_for_publish(5)
    client.loop_stop()
    client.disconnect()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
