"""The run-config reference: one list of documented keys, rendered where users read it.

Every key the loader accepts (:mod:`sfl_core.config.run`) is documented here once; the defaults
come from the config dataclasses, never from the text. The same list becomes the comment
block at the top of every shipped run config (``profiles/runs/*.yaml``) and the Markdown
reference in ``docs/config.md``, and a test checks that those files and the loader agree
with it. After adding a key: document it in :data:`FIELDS`, then regenerate with

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
     'iid | dirichlet (label skew) | data-imbalance | class-imbalance | extreme (FedFC splits; docs/methods.md section 4).'),
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
     'merged (feature merging: one server forward/backward over the concatenated activations of all agents) | per_agent (SplitFed v1: one server copy per agent, copies averaged) | sequential (SplitFed v2: one server copy updated agent after agent).'),
    ('server_weight',
     "how a merged server copy counts in the layer-wise average of mixed cuts: members (once per agent it trained for, weighted by their data; measured better) | once (one participant, FedFC's Alg. 3)."),
    ('split',
     "split point s (client portion = layers[:s]), >= 1; null = the model's default."),
    ('profile_splits',
     "FedFC mixed cut layers (strategy sfl): split point per device profile, e.g. {jetson-nano: 1, jetson-agx-xavier: 3}; other agents use split. With server_mode merged, one server pass joins each agent's rows at its own layer."),
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
    ('zstd_level',
     'zstd level for wire payloads, 0 (off) to 22.'),
    ('seed',
     'seed for selection, initialisation and batches, >= 0.'),
    ('server_flops',
     "coordinator FLOP/s for the virtual clock (S2FL 'server' class = 5e10)."),
    ('step_timeout_s',
     'an agent silent this long within a round is dropped.'),
    ('register_timeout_s',
     'how long to wait for min_agents to register.'),
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
    ('loss',
     "server-side training loss: ce (cross-entropy) | calibrated (FedLC logit calibration, Zhang et al. 2022: logit z_c - tau * n_c^(-1/4) with n_c the row's agent's count of class c; counters label skew)."),
    ('calibration_tau',
     'calibration strength tau >= 0 (0 = plain cross-entropy).'),
    ('s2fl',
     'S2FL switches, used when strategy is s2fl (docs/methods.md section 5)'),
    ('s2fl.sliding',
     'per-agent split from the client time table (warm-up: rounds 1..K use candidate k for everybody; then the median rule).'),
    ('s2fl.balance',
     "group agents so each group's label mix is closest to uniform (Eq. 2); one server copy per group. false = one copy per agent."),
    ('s2fl.group_size',
     'agents per group when balancing.'),
    ('s2fl.candidates',
     "candidate split points, e.g. [1, 2, 3]; null = the model's defaults (sfl_core/model/zoo.py). With sliding false the largest candidate is used (the paper's SFL baseline)."),
    ('mergesfl',
     'MergeSFL control (docs/methods.md section 7), on top of feature merging'),
    ('mergesfl.regulate',
     'batch-size regulation (Eq. 9): the fastest agent gets max_batch, the others d_i = floor(D (mu_l+beta_l)/(mu_i+beta_i)) so all take equally long; lr scales with the batch; aggregation weighted by batch size (Eq. 17).'),
    ('mergesfl.max_batch',
     "D, the fastest agent's batch (>= batch_size); null = batch_size."),
    ('mergesfl.select',
     "KL worker selection (Eq. 10-13): a genetic algorithm picks the agents whose merged label mix is closest to the population's, within the ingress budget; then batches are tuned (Eq. 14) and scaled to fill the budget. per_round is not used: the budget sets how many agents train (bound it with min_agents / max_agents)."),
    ('mergesfl.min_agents',
     'with select: the fewest agents a round takes, where the budget lets that many fit.'),
    ('mergesfl.max_agents',
     'with select: the most agents a round takes; null = no bound.'),
    ('mergesfl.min_batch',
     'the smallest batch regulation and selection give an agent (>= 2 keeps batch-norm layers from single-sample batches).'),
    ('mergesfl.budget_bytes',
     "coordinator ingress budget per round (activation bytes per step); null = per_round x batch_size samples' activations."),
    ('mergesfl.epsilon',
     'KL target (nats) of the batch fine-tuning.'),
    ('mergesfl.smoothing',
     'weight of the previous estimate of mu (compute s/sample) and beta (transfer s/sample), Eq. 5-6, in [0, 1).'),
    ('mergesfl.ga_population',
     'individuals of the genetic algorithm.'),
    ('mergesfl.ga_generations',
     'generations at most (stops after 30 without improvement).'),
    ('mergesfl.ga_crossover',
     'uniform-crossover probability in [0, 1].'),
    ('mergesfl.ga_mutation',
     'per-gene flip probability; null = 1/agents.'),
    ('hetero',
     'HeteroSFL (docs/methods.md section 6): agents grouped by link rate, each group with its own bottleneck width and/or codec'),
    ('hetero.width',
     'full (widest) bottleneck width P in channels; null = no bottleneck. Needs one fixed split (strategy sfl); under strategy auto use auto.widths.'),
    ('hetero.groups',
     'agents grouped by measured uplink rate into 1-4 groups.'),
    ('hetero.widths',
     "fixed width per group, slowest group first; null = widths proportional to the groups' rates (fastest = width)."),
    ('hetero.thresholds',
     'ascending uplink rates (B/s) separating the groups; null = equal-count quantiles.'),
    ('hetero.codecs',
     "codec per group, slowest group first (e.g. [topk4, fp32]); works with or without a bottleneck; null = the run's codec."),
    ('hetero.bdks',
     'bi-directional knowledge sharing (HeteroSFL Eq. 6-8) for every group wider than the narrowest: loss(wide) + bdks_alpha * N2W + W2N, on the server only (about 2x server compute for those rows).'),
    ('hetero.bdks_alpha',
     'weight of the narrow-to-wide distillation, >= 0.'),
    ('hetero.bdks_theta',
     "a class is under-represented in a group when its share of the group's data is below bdks_theta x its share of all agents' data, in [0, 1]."),
    ('auto',
     'the joint planner, used when strategy is auto (docs/methods.md section 11): each round, per agent, the split, codec (bottleneck width) and batch that make the slowest agent finish first while the merged batch keeps its size'),
    ('auto.candidates',
     "the cuts it chooses among (strictly increasing); null = the model's candidate splits."),
    ('auto.whole_model',
     'also consider the whole model on an agent (FedAvg-style: it trains locally and sends only its weights) where that finishes sooner than any cut.'),
    ('auto.selection',
     "which agents train each round: uniform = the engine's uniform sample of per_round; kl = among a pool drawn with priority to rarely chosen agents (MergeSFL Eq. 13), the per_round whose merged label mix is closest to the population's (MergeSFL Eq. 11-12). Default kl: with epsilon auto it reached the target 1.3-1.6x sooner than the uniform sample in the mixed-fleet, S2FL and MergeSFL p = 10 benches, and 0.91x as soon at MergeSFL p = 2 (docs/methods.md section 11). Where every online agent trains each round the two are the same."),
    ('auto.codecs',
     'the activation codecs it may choose among (only those within max_compression are used).'),
    ('auto.max_compression',
     'the strongest codec compression allowed, >= 1: fp16/bf16 = 2, int8 = 4, topk<P> = 67/P. Default 2 (fp16 measured at about 4e-4 relative error; int8 cost accuracy on the MergeSFL bench).'),
    ('auto.widths',
     "bottleneck widths (channels, HeteroSFL's encoder/decoder pair at the run's split, the widest its full width) it may give an agent cut at that split, within max_bottleneck; cuts then stop at that split (no later cut, no whole model), and an agent with time to spare sends the widest width that keeps the round's time. auto (the default) = decided once from the run's fleet: the full width and each quarter of it down to 1 channel that sends at least min_bottleneck_values values per sample, where they make the fleet's predicted round at the run's batch size at least 2.5x shorter (links that slow), else none (the run's notes and sfl-coord plan say which and why); a list = these widths; null = no bottleneck (docs/methods.md section 11)."),
    ('auto.max_bottleneck',
     'the strongest bottleneck compression allowed (the cut\'s channels over the width sent), >= 1.'),
    ('auto.min_bottleneck_values',
     "the fewest values per sample (width x the activation map's positions) a width of the widths: auto ladder may send, >= 1; default 64, the narrowest bottleneck the HeteroSFL paper measured (one 8x8 channel). Narrower ones stalled learning on 8x8 digits (2 channels of 4x4 = 32 values)."),
    ('auto.regulate',
     "plan batch sizes too (faster agents train larger batches, learning rate scaled with the batch, MergeSFL Eq. 15); false = every agent trains the run's batch_size."),
    ('auto.max_batch',
     'largest batch of one agent (1-4096); null = 2 x batch_size.'),
    ('auto.min_batch',
     'smallest batch of one agent (1-4096; batch-norm needs >= 2).'),
    ('auto.epsilon',
     "how far (KL, nats) regulated batches may move the merged batch's label mix from what equal batches would give, >= 0; auto = no limit where label-mix selection (kl) chose the round's agents out of more, else 0.05."),
    ('auto.smoothing',
     "weight of the previous estimate when a round's measured compute and link seconds arrive, in [0, 1); lower follows a device's slowdown faster."),
    ('privacy',
     "what the agents keep back and the defenses they apply to what they send (docs/methods.md section 12). A simulation applies them to its in-process agents; a deployed agent takes them from its own sfl-agent start flags (--nopeek, --activation-noise, --withhold-labels, --label-protection, --dp-sgd) and declares them when it registers. Each round's metrics record them."),
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
"""(key path, meaning) in the order users read them; a section's keys follow the section."""

_NO_DEFAULT = ("data", "fleet", "task", "task.classes", "task.input_shape", "eval", "s2fl", "mergesfl", "hetero",
               "auto", "privacy")   # sections, and the required keys
_RULE = "# " + "=" * 76 + " run config"
_END = "# " + "=" * 86


def accepted_keys() -> set[str]:
    """Every key path the run-config loader accepts."""
    to_yaml = {attr: key for key, attr in config.RunConfig.YAML_KEYS.items()}
    keys = {to_yaml.get(f.name, f.name) for f in dataclasses.fields(config.RunConfig)}
    for section, cls in (("data", config.DataConfig), ("task", config.TaskConfig), ("eval", config.EvalConfig),
                         ("s2fl", config.S2flConfig),
                         ("mergesfl", config.MergeSflConfig), ("hetero", config.HeteroConfig),
                         ("auto", config.AutoConfig), ("privacy", config.PrivacyConfig)):
        keys |= {f"{section}.{f.name}" for f in dataclasses.fields(cls)}
    return keys


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
    for path, text in FIELDS:
        default = None if path in _NO_DEFAULT else _value(values[path])
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
