"""The run-config reference: one list of documented keys, rendered where users read it.

Every key the loader accepts (:mod:`sfl_core.config.run`) is documented here once; the defaults
come from the config dataclasses, never from the text. The same list becomes the comment
block at the top of every shipped run config (``profiles/runs/*.yaml``) and the Markdown
reference in ``docs/config.md``, and a test checks that those files and the loader agree
with it. After adding a key: document it in :data:`FIELDS` (a method's own key: in its section's
``DOCS``), then regenerate with

    python -m sfl_core.config.reference --write
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

from sfl_core.config import run as config
from sfl_core.config.run import sections

PREAMBLE = (
    "Configuration reference (every key is optional unless marked; unknown keys are errors).",
    'Numbers may be written 5e9, 5.0e9, 5_000_000_000 or "5e9". `null` means "automatic".',
)

FIELDS: tuple[tuple[str, str], ...] = (
    ('run',
     'run id, [A-Za-z0-9_-], 1-64 chars; it becomes an MQTT topic level (sfl/<run>/...).'),
    ('model',
     "model name from the model zoo (e.g. small_cnn, resnet8), optionally with options: vgg16:width=0.25,norm=group (width multiplies every layer's channels; norm: batch | group | none); or your own: FILE.py:FUNCTION (a function returning an nn.Sequential, installed on the coordinator and on each device, sfl-agent start --model-file FILE.py), or {layers: [...]} (a layer list that travels in the run description; docs/models.md)."),
    ('data',
     'training data and how it is split over agents'),
    ('data.dataset',
     'digits (sklearn, offline) | mnist | fashion-mnist | cifar10 (binary distribution).'),
    ('data.root',
     'directory with the idx .gz files (not needed for digits); relative paths are relative to the working directory.'),
    ('data.partition',
     'iid | dirichlet (label skew) | data-imbalance | class-imbalance | extreme (FedFC splits; docs/methods/data-heterogeneity.md).'),
    ('data.alpha',
     'Dirichlet concentration a > 0; small = severe skew.'),
    ('data.seed',
     'seed of the partition.'),
    ('data.image_size',
     'resize images to N x N (e.g. 32 so 28x28 data fits VGG).'),
    ('data.bad_files',
     "a device's unreadable file (corrupt image, bad table row): skip (skipped, counted, the first ones named at WARNING) | fail (the device stops, naming the file; exit status 2)."),
    ('task',
     'a run on the devices\' own data (sfl-agent start --data PATH; docs/data.md): the contract every device\'s data must fit. Without it, agents train on shards of data.dataset'),
    ('task.classes',
     'REQUIRED in a task: the class names in label order, e.g. [cat, dog, bird]. Class folders and label values map to indices by these names, never by what one device holds; a device may lack a class; a name not listed is an error naming the folder.'),
    ('task.input_shape',
     'REQUIRED in a task: one sample\'s shape: [channels, height, width] for images, [features] for a table.'),
    ('task.scale',
     'raw values are divided by it first (255 for 8-bit pixels; 1 for data already scaled, e.g. float sensor readings).'),
    ('task.normalize',
     'per-channel standardisation shared by the whole fleet: federated (each agent reports per-channel count, sum and sum of squares at registration; the coordinator combines them once, before round 1, publishes them in the run description, sends them with every assignment and checkpoints them) | none | {mean: [...], std: [...]}. Exported models record the constants (sfl-agent predict --raw applies them).'),
    ('task.resize',
     'null (an image of another size is an error naming the file and both sizes) | N | [height, width] equal to input_shape\'s: images are resized bilinearly.'),
    ('task.label_column',
     'tables and Hugging Face data sets: the column holding the class name.'),
    ('task.features',
     'tables: the feature columns in order (input_shape [len(features)]); null = every column but the label.'),
    ('eval',
     'where the global model is scored'),
    ('eval.data',
     "the server's validation data in any format agents read (an image folder's val/ split if it has one, else all of it; needs task; relative to this file); null = none: the run says so at start and still trains."),
    ('eval.federated_every',
     'every k rounds the round\'s agents score the global model on their held-out split (val/ beside train/, x_val/y_val) and report loss, accuracy and count; metrics record each and their weighted mean; 0 = never.'),
    ('fleet',
     'REQUIRED (unless min_agents is set): list of {profile, count, data}; agent indices are assigned in list order. `profile` is a name from profiles/devices/ (sfl-agent profiles) or a path to a profile YAML (relative to this file, then to the working directory). count >= 1, default 1. A bare string entry means count 1. `data` (a run with task, simulate and plan): that device\'s own data, relative to this file; needs count 1.'),
    ('rounds',
     'communication rounds, > 0.'),
    ('per_round',
     'agents selected per round (<= fleet size); null = all.'),
    ('min_agents',
     'agents to wait for before round 1 (<= fleet size); null = whole fleet.'),
    ('strategy',
     'sfl (split learning) | fedavg (whole model on the agent) | s2fl (sliding split + data-balance groups, see s2fl) | auto (split, codec and batch planned per agent every round, see auto).'),
    ('server_mode',
     'auto (the default: merged, except that strategy auto decides it from the fleet: sequential, unless the devices are strongly label-skewed over a deep server portion or server workers share the round, docs/methods/auto.md) | merged (feature merging: one server forward/backward over the concatenated activations of all agents) | per_agent (SplitFed v1: one server copy per agent, copies averaged) | sequential (SplitFed v2: one server copy updated agent after agent).'),
    ('split',
     "split point s (client portion = layers[:s]), >= 1; null = the model's default."),
    ('batch_size',
     'samples per local iteration per agent, > 0.'),
    ('lr',
     'SGD learning rate, > 0.'),
    ('lr_decay',
     'learning rate of round r = lr x lr_decay^(r-1), in (0, 1].'),
    ('momentum',
     'SGD momentum in [0, 1).'),
    ('local_iters',
     'local iterations per round (tau), > 0.'),
    ('codec',
     'activation/gradient codec on the wire: fp32 | fp16 | bf16 | int8 | topk<P> (P=1..99), then zstd.'),
    ('window',
     "steps a split agent keeps in flight: it computes the next step's activations while the last ones travel and the server steps, and applies each gradient as it arrives (at most window - 1 updates stale; each step's gradient exact for the weights it was computed with). 1 (default): lock-step, as before; up to 16; auto: per agent the smallest of 1, 2, 4 whose predicted round is within 5 % of the fastest, priced with its cut, codec and batch (docs/methods/pipeline.md). Agents that withhold labels or run DP-SGD keep 1."),
    ('zstd_level',
     'zstd level for wire payloads, 0 (off) to 22.'),
    ('seed',
     'seed for selection, initialisation and batches, >= 0.'),
    ('server_flops',
     "coordinator FLOP/s for the virtual clock (S2FL 'server' class = 5e10)."),
    ('agent_step_overhead_s',
     "the coordinator's own seconds per split agent per local step, beyond the server's compute: receiving, decoding, encoding and publishing each agent's step messages and waiting for the step's slowest agent. A round of n split agents and tau steps adds tau x n x this to every split agent's time. The virtual clock charges it and the planners (auto, sfl-coord plan) price with it; under strategy auto a deployment measures it every round (metrics: auto.overhead_s) and plans with what it measured. A deployed run's metrics give the figure to simulate it with. Default 0: a simulated coordinator costs nothing."),
    ('step_timeout_s',
     'an agent silent this long within a round is dropped.'),
    ('register_timeout_s',
     'how long to wait for min_agents to register.'),
    ('round_deadline',
     "a deployed round's deadline in multiples of its predicted time (the time model's, from what its agents measured at registration and in earlier rounds), never less than round_deadline_min_s; agents still training then are stragglers. 0: no deadline (only step_timeout_s)."),
    ('round_deadline_min_s',
     'the shortest round deadline, in seconds.'),
    ('busy_timeout_s',
     "an agent whose heartbeats say busy while nothing it owes the round arrives for this long is dropped (a device that computes forever stalls nobody); an agent predicted to need longer between its messages (round_deadline x its predicted round, e.g. a whole model trained on a board) is given that instead."),
    ('stragglers',
     "what a deadline does with the agents still training: continue (drop them, the round goes on with the rest) | replan (drop them and plan the round again without them). Each is counted in the metrics (stragglers)."),
    ('min_completed',
     'agents that must complete a round for it to count (at most those selected); a round with fewer is not recorded: the model goes back to its start and the round is planned again (5 times at most, then the run stops with the completed rounds checkpointed).'),
    ('max_registered',
     'most agents the registry holds (registrations beyond it are refused once silent never-trained entries are pruned); null = 2 x the fleet size + 10.'),
    ('register_rate_per_s',
     'new agent ids accepted per second, burst the fleet size (a flood of invented ids is dropped and counted as rate_limited).'),
    ('output_dir',
     'where metrics and checkpoints go; null = runs/<run>.'),
    ('eval_samples',
     'evaluate on the first N samples of the test set (faster rounds in big simulations); null = the whole test set.'),
    ('eval_every',
     "score the global model on the server's validation set every k rounds and after the last (the rounds between record accuracy null); each round's metrics give the seconds it took (eval_s)."),
    ('privacy',
     "what the agents keep back and the defenses they apply to what they send (docs/methods/privacy.md). A simulation applies them to its in-process agents; a deployed agent takes them from its own sfl-agent start flags (--nopeek, --activation-noise, --withhold-labels, --label-protection, --dp-sgd) and declares them when it registers. Each round's metrics record them."),
    ('privacy.nopeek',
     'weight of NoPeek (Vepakomma et al. 2020): the distance correlation between a batch\'s inputs and its activations, added to the client portion\'s loss; 0 = off.'),
    ('privacy.activation_noise',
     "null, {clip: C, sigma: S} or \"C,S\": each sample's activations are scaled to an L2 norm of at most C, then Gaussian noise of standard deviation S x C is added to every value before they are sent."),
    ('privacy.withhold_labels',
     'true: agents send no labels; the coordinator returns their rows\' logits and each agent scores them and returns the logit gradients (MergeSFL).'),
    ('privacy.label_protection',
     "null, max_norm or a number SIGMA (needs withhold_labels): noise on the logit gradients agents return. max_norm (Li et al. 2022): each sample's expected gradient norm made the batch's largest; SIGMA: Gaussian noise of std SIGMA x sqrt 2 per sample's own-loss gradient."),
    ('privacy.dp_sgd',
     "null, {clip: C, sigma: S, delta: D} or \"C,S[,D]\": DP-SGD on the client portion (Abadi et al. 2016): each sample's gradient clipped to C, Gaussian noise of std S x C on the sum; each round records epsilon at delta D (default 1e-5; Opacus's accountant, the package's privacy extra). Not with nopeek."),
)
"""(key path, meaning) of the core keys in the order users read them; a section's keys follow the
section. Each method documents its own section (``DOCS`` of its config class)."""
SECTIONS_BEFORE = "privacy"
"""The methods' sections are listed just before this core key."""

_NO_DEFAULT = ("data", "fleet", "task", "task.classes", "task.input_shape", "eval", "privacy")
"""Sections (a method's or an option's section is one too), and the required keys: no default shown."""
_RULE = "# " + "=" * 76 + " run config"
_END = "# " + "=" * 86


def accepted_keys() -> set[str]:
    """Every key path the run-config loader accepts."""
    to_yaml = {attr: key for key, attr in config.RunConfig.YAML_KEYS.items()}
    keys = {to_yaml.get(f.name, f.name) for f in dataclasses.fields(config.RunConfig) if f.name != "sections"}
    parts = {"data": config.DataConfig, "task": config.TaskConfig, "eval": config.EvalConfig, **sections(),
             "privacy": config.PrivacyConfig}
    for section, cls in parts.items():
        keys |= {section} | {f"{section}.{f.name}" for f in dataclasses.fields(cls)}
        keys |= set(getattr(cls, "ALIASES", {}))   # a former core key, read into its section
    return keys


def documented() -> list[tuple[str, str]]:
    """(key path, meaning) of every key: the core keys of :data:`FIELDS`, with each method's
    section (its ``DOCS``) where :data:`SECTIONS_BEFORE` stands."""
    out: list[tuple[str, str]] = []
    for path, text in FIELDS:
        if path == SECTIONS_BEFORE:
            for key, section in sections().items():
                out += [(f"{key}.{sub}" if sub else key, meaning) for sub, meaning in section.DOCS]
                out += [(alias, f"the same as {key}.{name} (a top-level key of earlier run files)")
                        for alias, name in section.ALIASES.items()]
        out.append((path, text))
    return out


def defaults() -> dict[str, Any]:
    """Key path -> default, read from the dataclasses through the loader itself."""
    d = config.run_config_to_dict(config.run_config_from_dict({"fleet": [{"profile": "s2fl-low-low"}],
                                                              "task": {"classes": ["a", "b"], "input_shape": [1]}}))

    def flat(m: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
        for k, v in m.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            yield prefix + k, v
    return dict(flat(d))


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.0e}".replace("e+", "e") if abs(v) >= 1e6 else (f"{v:.1f}" if v.is_integer() else f"{v:g}")
    return str(v)


def _entries() -> Iterator[tuple[str, str, str, str | None]]:
    """(path, key, meaning, default text or None) per documented key."""
    values = defaults()
    for path, text in documented():
        aliases = {alias for section in sections().values() for alias in section.ALIASES}
        default = None if path in _NO_DEFAULT or path in sections() or path in aliases else _value(values[path])
        yield path, path.rsplit(".", 1)[-1], text, default


def render_yaml_header() -> str:
    """The comment block every shipped run config starts with."""
    lines = [_RULE, *(f"# {p}" for p in PREAMBLE), "#"]
    for path, key, text, default in _entries():
        indent = "  " if "." in path else ""
        full = text + (f" Default: {default}" if default is not None else "")
        lead = f"# {indent}{key}:".ljust(23)
        wrapped = textwrap.wrap(full, width=92 - 23) or [""]
        lines.append(lead + wrapped[0])
        lines += ["#" + " " * 22 + w for w in wrapped[1:]]
    lines.append(_END)
    return "\n".join(lines) + "\n"


def render_markdown() -> str:
    """``docs/config.md``: the same reference as a table."""
    out = ["# Run configuration reference", "",
           "<!-- generated by `python -m sfl_core.config.reference --write`; edit sfl_core/config/reference.py -->",
           "", *PREAMBLE, "", "| key | meaning | default |", "|---|---|---|"]
    for path, _key, text, default in _entries():
        cell = text.replace("|", "\\|").replace("<", "&lt;")
        out.append(f"| `{path}` | {cell} | {'' if default is None else f'`{default}`'} |")
    return "\n".join(out) + "\n"


def with_header(text: str) -> str:
    """A run config's text with its reference block replaced by the current one."""
    if text.startswith(_RULE):
        end = text.find(_END)
        if end >= 0:
            text = text[end + len(_END):].lstrip("\n")
    return render_yaml_header() + "\n" + text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true",
                   help="rewrite docs/config.md and the header of every profiles/runs/*.yaml")
    p.add_argument("--markdown", action="store_true", help="print the Markdown reference (default: the YAML block)")
    args = p.parse_args(argv)
    if args.write:
        root = Path(__file__).resolve().parents[2]
        (root / "docs" / "config.md").write_text(render_markdown())
        for f in sorted((config.default_profiles_dir() / "runs").glob("*.yaml")):
            f.write_text(with_header(f.read_text()))
        return 0
    sys.stdout.write(render_markdown() if args.markdown else render_yaml_header())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
