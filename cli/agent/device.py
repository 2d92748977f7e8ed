"""``sfl-agent profile`` and ``predict``: measure this device, run an exported model on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from cli.agent.app import app, console, tell
from cli.broker_options import CaFile, CertFile, KeyFile, PasswordFile, address_from_options


@app.command()
def profile(model: str = typer.Option("small_cnn", help="A zoo model name (`sfl-coord models` lists them)."),
            input_shape: str = typer.Option("1,28,28", help="Per-sample input shape."),
            classes: int = typer.Option(10),
            batch_size: int = typer.Option(16),
            detect: bool = typer.Option(False, "--detect", help="Write a device profile of this device: the "
                                        "FLOP/s of training the model's client portions, the memory and the "
                                        "link (through --broker, or --link-mbps); YAML to --output or stdout."),
            output: Optional[Path] = typer.Option(None, "--output", "-o", help="--detect: the profile file to write."),
            name: Optional[str] = typer.Option(None, help="--detect: the profile's name (default: the file's stem, "
                                               "else this host's name)."),
            broker: Optional[str] = typer.Option(None, help="--detect: measure the link through this broker "
                                                 "(probes echoed by the broker to this client; a symmetric link is "
                                                 "assumed)."),
            link_mbps: Optional[float] = typer.Option(None, help="--detect: the uplink in Mb/s, instead of "
                                                      "measuring it through --broker."),
            topic: Optional[str] = typer.Option(None, help="--detect: the topic echoed through the broker "
                                                "(default sfl/profile/<random>); it must be one this client may "
                                                "publish and subscribe to."),
            ca_file: CaFile = None, cert_file: CertFile = None, key_file: KeyFile = None,
            password_file: PasswordFile = None) -> None:
    """Time forward+backward of every client portion on this device (what `start` reports at
    registration); with --detect, write it all as a device profile a run can use."""
    from edge_agent.profiler import measure_compute
    from sfl_core.model.accounting import model_costs
    from sfl_core.model.zoo import build_model

    if detect and broker is None and link_mbps is None:
        tell("--detect needs the link: --broker URL to measure it, or --link-mbps N")
        raise typer.Exit(2)
    if link_mbps is not None and not link_mbps > 0:
        tell(f"--link-mbps must be a positive number, got {link_mbps}")
        raise typer.Exit(2)
    try:
        shape = tuple(int(v) for v in input_shape.split(","))
        m = build_model(model, shape, classes)
    except (ValueError, KeyError) as exc:
        tell(f"--model {model} --input-shape {input_shape}: {exc}")
        raise typer.Exit(2)
    costs = model_costs(model, shape, classes)
    splits = list(m.split_points)
    secs = measure_compute(m, splits, {s: costs[s].client_flops for s in splits}, batch_size=batch_size)
    if not detect:
        console.print(f"{model} {shape}: seconds per sample (fwd+bwd of the client portion)")
        for s in splits:
            gflops = costs[s].client_flops / secs[s] / 1e9 if secs[s] > 0 else float("inf")
            console.print(f"  split {s:>2} ({m.block_names[s - 1]:>8}): {secs[s] * 1e3:8.3f} ms/sample  "
                          f"~{gflops:.2f} GFLOP/s")
        return
    _write_detected_profile(model, shape, batch_size, secs, {s: costs[s].client_flops for s in splits}, output=output,
                            name=name, broker=broker, link_mbps=link_mbps, topic=topic,
                            tls=(ca_file, cert_file, key_file, password_file))


def _write_detected_profile(model: str, shape: tuple, batch_size: int, secs: dict, flops: dict, *,
                            output: Optional[Path], name: Optional[str], broker: Optional[str],
                            link_mbps: Optional[float], topic: Optional[str], tls: tuple) -> None:
    import os
    import platform
    import queue

    import torch

    from edge_agent.device_profile import Measured, profile_text
    from edge_agent.profiler import measure_broker_echo, own_rss, physical_memory
    from sfl_core.config.run import ConfigError
    from sfl_core.transport.mqtt_link import MqttLink

    link, how = None, f"{link_mbps} Mb/s as given (--link-mbps)"
    if broker is not None and link_mbps is None:
        try:
            address = address_from_options(broker, *tls)
        except ValueError as exc:
            tell(f"--broker: {exc}")
            raise typer.Exit(2)
        echoes: "queue.Queue[bytes]" = queue.Queue()
        topic = topic or f"sfl/profile/{os.urandom(4).hex()}"
        mqtt = MqttLink(address, f"sfl-profile-{os.urandom(4).hex()}", lambda _t, payload: echoes.put(payload),
                        subscriptions=[topic])
        try:
            mqtt.connect(timeout=15)
            def send(b: bytes) -> None:
                mqtt.publish(topic, b, qos=0)
            link = measure_broker_echo(send, echoes)
        except (ConnectionError, TimeoutError, OSError) as exc:
            tell(f"--broker {address.url()}: {exc}")
            raise typer.Exit(1)
        finally:
            mqtt.close()
        how = f"echoed through {address.url()} (symmetric link assumed)"
    ram, runtime = physical_memory(), own_rss()
    # memory_bytes is what training may use: the board's RAM less what the agent's runtime holds
    measured = Measured(model, shape, batch_size, secs, flops, ram - runtime if ram and runtime else ram, link, how,
                        ram_bytes=ram, runtime_bytes=runtime)
    name = name or (output.stem if output is not None else platform.node() or "my-board")
    try:
        text = profile_text(name, measured, link_bytes_per_s=link_mbps * 1e6 / 8 if link_mbps else None,
                            torch_version=torch.__version__)
    except ConfigError as exc:
        tell(f"the measured profile is not valid: {exc}")
        raise typer.Exit(1)
    if output is None:
        print(text, end="")
        return
    try:
        output.write_text(text)
    except OSError as exc:
        tell(f"{output}: cannot write: {exc.strerror or exc}")
        raise typer.Exit(2)
    console.print(f"wrote {output}: use it with `sfl-agent start --profile {output}` and in a run config's fleet "
                  f"(profile: {output.resolve()})")


@app.command()
def predict(model: Path = typer.Argument(..., help="An .onnx file from `sfl-coord export` (its .json sidecar beside it)."),
            inputs: Path = typer.Argument(..., help=".npy array (N x input shape, float32, or one sample), "
                                          "or .npz with key 'x'; preprocessed like the run's training data "
                                          "(or raw pixels, with --raw). With --raw also a photo, or a folder "
                                          "of them (a <class>/<image> folder gives the true classes)."),
            output: Optional[Path] = typer.Option(None, "--output", "-o", help="Also write the predictions as JSON."),
            labels_file: Optional[Path] = typer.Option(None, "--labels", help="The inputs' true classes (.npy of "
                                                       "integers, or .npz with key 'y'): adds a 'true' column "
                                                       "and the accuracy."),
            raw: bool = typer.Option(False, "--raw", help="The inputs are raw pixels: scale, resize and "
                                     "standardise them as the run did (constants from the model's sidecar)."),
            show: int = typer.Option(20, help="Rows shown in the table (--output gets all of them)."),
            threads: Optional[int] = typer.Option(None, help="onnxruntime threads; default: all cores.")) -> None:
    """Classify local inputs with an exported model, with onnxruntime only (no torch needed)."""
    import json

    import numpy as np
    from rich.table import Table

    from sfl_core.model.onnx_export import (
        IMAGE_SUFFIXES,
        OnnxError,
        OnnxPredictor,
        load_inputs,
        load_labels,
        load_raw_images,
        preprocess_raw,
        softmax,
    )

    try:
        predictor = OnnxPredictor(model, threads=threads)
        if predictor.meta.get("output", "logits") != "logits":
            raise OnnxError(f"{model} is a client portion (split {predictor.meta.get('split')}): it outputs "
                            "activations, not class scores; export the whole model (no --split) to predict")
        truth = None
        if raw and (inputs.is_dir() or inputs.suffix.lower() in IMAGE_SUFFIXES):
            x, truth, _files = load_raw_images(inputs, predictor.meta.get("preprocessing"), predictor.classes)
        else:
            x = load_inputs(inputs)
            if raw:
                x = preprocess_raw(x, predictor.meta.get("preprocessing"))
        logits = predictor.run(x)
        if labels_file is not None:
            truth = load_labels(labels_file, logits.shape[0], logits.shape[1])
    except OnnxError as exc:
        tell(str(exc))
        raise typer.Exit(2)
    probs = softmax(logits.astype(np.float64))
    cls = probs.argmax(axis=1)
    names = predictor.classes or [str(i) for i in range(probs.shape[1])]

    def name(c: int) -> str:
        return names[c] if c < len(names) else str(c)

    # "predicted", not "label": the column is the model's answer, never ground truth
    rows = [{"row": i, "class": int(c), "predicted": name(int(c)), "probability": float(probs[i, c])}
            for i, c in enumerate(cls)]
    if truth is not None:
        for r, t in zip(rows, truth):
            r["true"] = name(int(t))
    table = Table(title=f"{predictor.meta.get('model', model.name)}: {len(rows)} row(s) from {inputs}")
    columns = ("row", "class", "predicted", "probability") + (("true",) if truth is not None else ())
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows[:max(show, 0)]:
        table.add_row(str(r["row"]), str(r["class"]), str(r["predicted"]), f"{r['probability']:.4f}",
                      *((str(r["true"]),) if truth is not None else ()))
    Console().print(table)
    if len(rows) > show:
        console.print(f"... {len(rows) - max(show, 0)} more row(s); --output writes them all")
    counts = np.bincount(cls, minlength=probs.shape[1])
    console.print("predicted class counts: " + ", ".join(f"{name(i)}: {n}" for i, n in enumerate(counts) if n))
    accuracy = None
    if truth is not None:
        hits = int((cls == truth).sum())
        accuracy = hits / len(truth) if len(truth) else 0.0
        against = labels_file if labels_file is not None else f"the class folders of {inputs}"
        console.print(f"accuracy: {accuracy:.4f} ({hits}/{len(truth)} against {against})")
    if output is not None:
        doc: dict[str, Any] = {"model": str(model), "inputs": str(inputs), "model_info": predictor.meta,
                               "predictions": rows}
        if truth is not None:
            doc.update(labels=str(labels_file) if labels_file is not None else "class folders", accuracy=accuracy)
        output.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {output}")
