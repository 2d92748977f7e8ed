"""``sfl-agent profile`` and ``predict``: measure this device, run an exported model on it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cli.agent.app import app, console, tell


@app.command()
def profile(model: str = typer.Option("small_cnn", help="A zoo model name (`sfl-coord models` lists them)."),
            input_shape: str = typer.Option("1,28,28", help="Per-sample input shape."),
            classes: int = typer.Option(10),
            batch_size: int = typer.Option(16)) -> None:
    """Time forward+backward of every client portion on this device (what `start` reports at registration)."""
    from edge_agent.profiler import measure_compute
    from sfl_core.model.accounting import model_costs
    from sfl_core.model.zoo import build_model

    shape = tuple(int(v) for v in input_shape.split(","))
    m = build_model(model, shape, classes)
    costs = model_costs(model, shape, classes)
    splits = list(m.split_points)
    secs = measure_compute(m, splits, {s: costs[s].client_flops for s in splits}, batch_size=batch_size)
    console.print(f"{model} {shape}: seconds per sample (fwd+bwd of the client portion)")
    for s in splits:
        gflops = costs[s].client_flops / secs[s] / 1e9 if secs[s] > 0 else float("inf")
        console.print(f"  split {s:>2} ({m.block_names[s - 1]:>8}): {secs[s] * 1e3:8.3f} ms/sample  ~{gflops:.2f} GFLOP/s")


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
        table.add_row(str(r["row"]), str(r["class"]), r["predicted"], f"{r['probability']:.4f}",
                      *((r["true"],) if truth is not None else ()))
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
        doc = {"model": str(model), "inputs": str(inputs), "model_info": predictor.meta, "predictions": rows}
        if truth is not None:
            doc.update(labels=str(labels_file) if labels_file is not None else "class folders", accuracy=accuracy)
        output.write_text(json.dumps(doc, indent=1) + "\n")
        console.print(f"wrote {output}")
