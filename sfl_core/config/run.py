"""Device profiles and run configurations: YAML in, frozen (pydantic) dataclasses out.

Why strict validation and not ``yaml.safe_load`` + ``**kwargs``: run files are written by
people, often on a device over SSH, and a typo (``local_iter: 20``) that is silently ignored
costs a whole training run. So every key is checked, every number is range-checked, and every
error names the file, the field path (``fleet[1].count``) and what was expected. Numbers
arrive as strings surprisingly often (PyYAML reads ``5e9`` as a string because YAML 1.1
floats need a dot), so numeric strings are accepted for numbers.

The types are pydantic v2 dataclasses (:mod:`sfl_core.config.fields` holds the glue): pydantic does
the walking, nesting and construction, and ``dataclasses.replace`` re-validates; each field's
check is a small converter that says what it expects, so the messages stay one line each.
Relations between fields are each section's ``_relations`` (after its fields are checked).

Nothing here touches the network; loading a run file reads only YAML files.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import asdict, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

from pydantic import ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    YAML_SUFFIXES,
    ConfigError,
    Conv,
    Fail,
    Section,
    checked,
    invalid,
    looks_like_path,
    number,
    read_section,
    read_yaml,
    validate,
)
from sfl_core.config.values import (
    AT_LEAST_0,
    BOOLEAN,
    NONEMPTY_STRING,
    NONNEG_INTEGER,
    OPTIONAL_POSITIVE_INTEGER,
    OPTIONAL_POSITIVE_NUMBER,
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    UNIT_OPEN,
    integer_in,
    nonempty_string,
    nonneg_number,
    number_in,
    one_of,
    optional,
)
from sfl_core.data.partition import SCHEMES
from sfl_core import method_registry, option_registry
from sfl_core.method_registry import DEFAULT_STRATEGY, strategies
from sfl_core.privacy import ActivationNoise, AgentPrivacy, DpSgd, LabelProtection, require_accountant
from sfl_core.wire.codec import CODECS, TOPK_PATTERN, is_codec
from sfl_core.wire.protocol import check_id

__all__ = [
    "CODECS",
    "ConfigError",
    "DataConfig",
    "DeviceProfile",
    "EvalConfig",
    "FleetEntry",
    "PARTITIONS",
    "RunConfig",
    "SERVER_MODES",
    "TaskConfig",
    "task_from_wire",
    "default_profiles_dir",
    "profiles_origin",
    "list_profiles",
    "load_profile",
    "load_run_config",
    "profile_from_dict",
    "run_config_from_dict",
    "run_config_to_dict",
]

LOSSES = ("ce", "calibrated")
"""The server's loss: cross-entropy, or logit calibration (FedLC, as HeteroSFL uses it).
Strategies are the methods' names (:func:`sfl_core.methods.strategies`)."""
SERVER_MODES = ("merged", "per_agent", "sequential")
"""'merged' = feature merging (one server batch per step); 'per_agent' = SplitFed v1 (a server
copy per agent, averaged); 'sequential' = SplitFed v2 (one server copy, updated agent after agent)."""
PARTITIONS = SCHEMES
"""How the training set is split over agents (docs/methods/data-heterogeneity.md)."""
MAX_CAPACITY_CHANGES = 1000
"""Most entries of a profile's ``capacity`` schedule (a received profile is bounded too)."""


def sections() -> dict[str, Any]:
    """Every section a run config reads beside its core keys: the methods', then the training
    options', by YAML key."""
    return {**method_registry.sections(), **option_registry.sections()}


# ------------------------------------------------------------------------ field checks
# Each converter takes the raw value and ``fail``; ``fail(what)`` reports "expected <what>".


def _text(v: Any, fail: Fail) -> str:
    """Free text (descriptions); empty is fine, but a number or list is a mistake."""
    if v is None:
        return ""
    if not isinstance(v, str):
        fail("a string")
    return v


def _ident(v: Any, fail: Fail) -> str:
    try:
        return check_id("run", v)
    except ValueError:
        fail("1-64 characters of letters, digits, '-' or '_' (it becomes an MQTT topic level)")


def _strategy(v: Any, fail: Fail) -> str:
    """A built-in strategy or one registered with :func:`sfl_core.methods.register_method`."""
    known = strategies()
    if v not in known:
        fail("one of " + ", ".join(repr(c) for c in known))
    return v


def _split_map(v: Any, fail: Fail) -> dict[str, int]:
    if not isinstance(v, dict) or not v or not all(isinstance(k, str) and isinstance(x, int) and
                                                   not isinstance(x, bool) and x >= 1 for k, x in v.items()):
        fail("a mapping of device profile name to split point (an integer >= 1), or null")
    return dict(v)


def _codec(v: Any, fail: Fail) -> str:
    if not is_codec(v):
        fail("one of " + ", ".join(repr(c) for c in CODECS) + f" or {TOPK_PATTERN}")
    return v


def _model(v: Any, fail: Fail) -> str:
    """A zoo model name, a spec string (``vgg16:width=0.25,norm=group``), a mapping
    ``{name: vgg16, width: 0.25, norm: group}``, a user's ``FILE.py:FUNCTION`` or a layer list
    ``{layers: [...]}`` (:mod:`sfl_core.model.user_models`); stored as the canonical spec string."""
    from sfl_core.model.user_models import FILE_REF, register_file_model, register_layers
    from sfl_core.model.zoo import ModelSpec  # torch is only needed once a model is named

    if isinstance(v, Mapping) and set(v) == {"layers"}:
        try:
            return register_layers(v["layers"])
        except ValueError as exc:
            fail(f"a valid layer list ({exc})")
    if isinstance(v, str) and FILE_REF.match(v.strip()):
        ref = FILE_REF.match(v.strip())
        try:
            v = register_file_model(ref["path"], ref["func"]) + (f":{ref['opts']}" if ref["opts"] else "")
        except ValueError as exc:
            fail(f"a model file and function, FILE.py:FUNCTION ({exc})")
    if isinstance(v, Mapping):
        extra = set(v) - {"name", "width", "norm"}
        if extra or "name" not in v:
            fail("a mapping with 'name' and optionally 'width', 'norm'")
        opts = [f"{k}={v[k]}" for k in ("width", "norm") if k in v]
        v = str(v["name"]) + (":" + ",".join(opts) if opts else "")
    if not isinstance(v, str):
        fail("a model name such as 'vgg16' or 'vgg16:width=0.25'")
    try:
        return str(ModelSpec.parse(v))
    except ValueError as exc:
        fail(f"a known model with valid options ({exc})")
        raise


def _capacity(v: Any, fail: Fail) -> tuple[tuple[int, float, float], ...]:
    """A profile file writes ``{from_round, compute, link}`` entries; a registration (and an older
    checkpoint) sends ``[from_round, compute, link]`` triples. Both mean the same schedule."""
    what = ("a list of {from_round: R >= 1, compute: scale > 0, link: scale > 0} with rounds ascending")
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) > MAX_CAPACITY_CHANGES:
        fail(what)
    out = []
    for e in v:
        if isinstance(e, (list, tuple)) and len(e) == 3:
            e = {"from_round": e[0], "compute": e[1], "link": e[2]}
        if not isinstance(e, dict) or set(e) - {"from_round", "compute", "link"} or "from_round" not in e:
            fail(what)
        r, c, l = e["from_round"], number(e.get("compute", 1.0)), number(e.get("link", 1.0))
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or c is None or l is None or c <= 0 or l <= 0:
            fail(what)
        out.append((r, float(c), float(l)))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        fail(what)
    return tuple(out)


# ------------------------------------------------------------------------ device profiles


def capacity_scales(capacity: Sequence[Sequence[float]], r: int) -> tuple[float, float]:
    """(compute, link) scale in force in round ``r`` under a capacity schedule (1, 1 before any)."""
    compute, link = 1.0, 1.0
    for from_round, c, l in capacity:
        if r >= from_round:
            compute, link = float(c), float(l)
    return compute, link


@dataclass(frozen=True, config=STRICT)
class DeviceProfile(Section):
    """What the timing model (docs/methods/time-model.md) needs to know about one kind of device: read from
    a profile file, and the same type once an agent has registered it with the coordinator."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"compute_flops": "a positive number",
                                             "link_bytes_per_s": "a positive number",
                                             "name": "a non-empty string"}

    name: Annotated[str, NONEMPTY_STRING]
    compute_flops: Annotated[float, POSITIVE_NUMBER]  # sustained FLOP/s for training (fp32)
    link_bytes_per_s: Annotated[float, POSITIVE_NUMBER]  # uplink rate, bytes/s
    downlink_bytes_per_s: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None  # None -> link_bytes_per_s
    latency_s: Annotated[float, checked(nonneg_number)] = 0.0  # one-way latency
    memory_bytes: Annotated[Optional[float], OPTIONAL_POSITIVE_NUMBER] = None
    description: Annotated[str, checked(_text)] = ""
    source: Annotated[str, checked(_text)] = ""  # where the numbers come from
    capacity: Annotated[tuple[tuple[int, float, float], ...], checked(_capacity)] = ()
    """Capacity that changes over time, for emulation and simulation: ``(from_round, compute
    scale, link scale)`` entries, ascending; from that round on the device runs at the scaled
    FLOP/s and link rates (e.g. thermal throttling, a congested link)."""

    def __post_init__(self) -> None:
        # Most links are quoted as one number; a symmetric link is the honest default.
        if self.downlink_bytes_per_s is None:
            object.__setattr__(self, "downlink_bytes_per_s", self.link_bytes_per_s)

    @property
    def downlink(self) -> float:
        """The downlink rate as a float (``downlink_bytes_per_s`` is never None after init)."""
        return float(self.downlink_bytes_per_s or self.link_bytes_per_s)

    def at_round(self, r: int) -> "DeviceProfile":
        """This profile as the device runs in round ``r`` (the latest capacity change in force)."""
        compute, link = capacity_scales(self.capacity, r)
        if (compute, link) == (1.0, 1.0):
            return self
        return replace(self, compute_flops=self.compute_flops * compute, link_bytes_per_s=self.link_bytes_per_s * link,
                       downlink_bytes_per_s=self.downlink * link)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (msgpack/YAML friendly); ``profile_from_dict`` reads it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["capacity"] = [{"from_round": r, "compute": c, "link": lk} for r, c, lk in self.capacity]
        return d


# ------------------------------------------------------------------------ run configs


def _data_path(v: Any, fail: Fail) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        fail("a path to data (an image folder, .npz, CSV, Parquet ...), or null")
    return v


def _anchored(v: Optional[str], info: ValidationInfo) -> Optional[str]:
    """A data path read from a file is relative to that file (``hf:`` builder references as given)."""
    base = (info.context or {}).get("base_dir")
    if v is None or base is None or Path(v).is_absolute() or v.startswith("hf:"):
        return v
    return str((Path(base) / v).resolve())


def _resolve_profile_path(p: str, base_dir: Path | None) -> str:
    """Relative profile paths: next to the run file first, then the working directory."""
    path = Path(p)
    if path.is_absolute():
        return str(path)
    if base_dir is not None and (base_dir / path).is_file():
        return str((base_dir / path).resolve())
    return str(path.resolve())


@dataclass(frozen=True, config=STRICT)
class FleetEntry(Section):
    """``count`` agents of one device profile (a profile name, or an absolute YAML path).

    Read from a file (validation context ``base_dir``/``search_dirs``), a relative path is
    resolved against the run file and the profile is loaded at once: a bad fleet fails when the
    file is read, not when agent 37 starts."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"profile": "a device profile name or YAML path"}
    SHORTHAND: ClassVar[str] = "profile"   # '- jetson-nano' is one agent

    profile: Annotated[str, NONEMPTY_STRING]
    count: Annotated[int, POSITIVE_INTEGER] = 1
    data: Annotated[Optional[str], checked(_data_path)] = None
    """A simulated device's own data (a run with ``task``), relative to the run file; needs count 1."""


    @field_validator("data")
    @classmethod
    def _anchor_data(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        return _anchored(v, info)

    @model_validator(mode="after")
    def _one_device_one_folder(self) -> "FleetEntry":
        if self.data is not None and self.count != 1:
            raise invalid("count", f"one data path is one device: expected count 1 with 'data', got {self.count}")
        return self

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str, info: ValidationInfo) -> str:
        ctx = info.context
        if not ctx or "search_dirs" not in ctx:
            return name
        if looks_like_path(name):
            name = _resolve_profile_path(name, ctx.get("base_dir"))
        try:
            load_profile(name, ctx["search_dirs"])
        except ConfigError as exc:
            raise invalid("", f"expected a known device profile: {exc}") from None
        return name


@dataclass(frozen=True, config=STRICT)
class DataConfig(Section):
    dataset: Annotated[str, NONEMPTY_STRING] = "digits"
    root: Annotated[Optional[str], checked(optional(nonempty_string))] = None  # relative paths are relative to the working directory
    partition: Annotated[str, checked(one_of(*PARTITIONS))] = "iid"
    alpha: Annotated[float, POSITIVE_NUMBER] = 0.5  # Dirichlet concentration; only used when partition == 'dirichlet'
    seed: Annotated[int, NONNEG_INTEGER] = 0
    image_size: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # resize images to image_size x image_size
    bad_files: Annotated[str, checked(one_of("skip", "fail"))] = "skip"
    """A device's unreadable file: skipped and counted ('skip'), or the end of that device ('fail')."""


def _class_names(v: Any, fail: Fail) -> tuple[str, ...]:
    what = "a list of at least two distinct class names (folder names), in label order"
    if not isinstance(v, (list, tuple)) or len(v) < 2:
        fail(what)
    names = []
    for c in v:
        if isinstance(c, bool) or not isinstance(c, (str, int)) or not str(c).strip() or "/" in str(c) \
                or str(c) in (".", ".."):
            fail(what)
        names.append(str(c))
    if len(set(names)) != len(names):
        fail(what)
    return tuple(names)


def _input_shape(v: Any, fail: Fail) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= 3 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in v):
        fail("a per-sample shape: [channels, height, width] for images, [features] for a table")
    return tuple(v)


def _normalize(v: Any, fail: Fail) -> Union[str, tuple[tuple[float, ...], tuple[float, ...]]]:
    what = "'federated', 'none' or {mean: [one per channel], std: [positive, one per channel]}"
    if v in ("federated", "none"):
        return v
    if not isinstance(v, Mapping) or set(v) != {"mean", "std"}:
        fail(what)
    mean = [number(x) for x in v["mean"]] if isinstance(v["mean"], (list, tuple)) else None
    std = [number(x) for x in v["std"]] if isinstance(v["std"], (list, tuple)) else None
    if not mean or not std or len(mean) != len(std) or any(x is None for x in mean + std) or any(x <= 0 for x in std):
        fail(what)
    return tuple(float(x) for x in mean), tuple(float(x) for x in std)


def _resize(v: Any, fail: Fail) -> Optional[tuple[int, int]]:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                                           and d >= 1 for d in v):
        return tuple(v)
    fail("null (images must already have the run's size), a size N (N x N) or [height, width]")


def _names(v: Any, fail: Fail) -> Optional[tuple[str, ...]]:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v):
        fail("a non-empty list of column names, or null (every column but the label)")
    return tuple(v)


@dataclass(frozen=True, config=STRICT)
class TaskConfig(Section):
    """The task every device's data must fit (docs/data.md): the label contract (class names in
    order: a class folder or label maps to its index here, never by what one device happens to
    hold), the per-sample input shape and how raw inputs are prepared. Agents receive it in the
    run description and check their data against it before registering."""

    REQUIRED: ClassVar[Mapping[str, str]] = {"classes": "the class names in label order",
                                             "input_shape": "the per-sample input shape"}

    classes: Annotated[tuple[str, ...], checked(_class_names)]
    input_shape: Annotated[tuple[int, ...], checked(_input_shape)]
    scale: Annotated[float, POSITIVE_NUMBER] = 255.0
    """Raw values are divided by it first (255 for 8-bit pixels; 1 for data already scaled)."""
    normalize: Annotated[Union[str, tuple[tuple[float, ...], tuple[float, ...]]], checked(_normalize)] = "federated"
    """Per-channel standardisation: 'federated' (from the devices' statistics, once, before round 1),
    'none', or given constants."""
    resize: Annotated[Optional[tuple[int, int]], checked(_resize)] = None
    """Resize images to this size (bilinear); null: an image of another size is an error."""
    label_column: Annotated[str, NONEMPTY_STRING] = "label"
    """Tables and Hugging Face data sets: the column holding the class name."""
    features: Annotated[Optional[tuple[str, ...]], checked(_names)] = None
    """Tables: the feature columns, in order; null: every column but the label."""

    @model_validator(mode="after")
    def _relations(self) -> "TaskConfig":
        if self.resize is not None and len(self.input_shape) != 3:
            raise invalid("resize", "resizing needs image inputs ([channels, height, width])")
        if self.resize is not None and tuple(self.resize) != tuple(self.input_shape[1:]):
            raise invalid("resize", f"expected the input_shape's size {list(self.input_shape[1:])}, "
                                    f"got {list(self.resize)}")
        if isinstance(self.normalize, tuple) and len(self.normalize[0]) != self.input_shape[0]:
            raise invalid("normalize", f"expected {self.input_shape[0]} means and stds (one per channel), "
                                       f"got {len(self.normalize[0])}")
        if self.features is not None and (len(self.input_shape) != 1 or len(self.features) != self.input_shape[0]):
            raise invalid("features", f"expected input_shape [{len(self.features)}] for {len(self.features)} "
                                      f"feature columns, got {list(self.input_shape)}")
        return self

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to_wire(self) -> dict[str, Any]:
        """As the run description carries it (plain lists; ``task_from_wire`` reads it back)."""
        norm = self.normalize
        return {"classes": list(self.classes), "input_shape": list(self.input_shape), "scale": self.scale,
                "normalize": norm if isinstance(norm, str) else {"mean": list(norm[0]), "std": list(norm[1])},
                "resize": list(self.resize) if self.resize else None, "label_column": self.label_column,
                "features": list(self.features) if self.features else None}


def task_from_wire(d: Any, source: str = "run_info.task") -> TaskConfig:
    """A task as a run description carries it, validated like the run config's ``task:``."""
    return validate(TaskConfig, d, source)


@dataclass(frozen=True, config=STRICT)
class EvalConfig(Section):
    """Where the global model is scored (docs/data.md): the server's own validation data, and
    the devices' held-out splits (federated evaluation)."""

    data: Annotated[Optional[str], checked(_data_path)] = None
    """The server's validation data, in any format agents read (needs ``task``); relative to the run file."""
    federated_every: Annotated[int, NONNEG_INTEGER] = 0
    """Every k rounds, the round's agents score the global model on their held-out split (0: never)."""

    @field_validator("data")
    @classmethod
    def _anchor(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        return _anchored(v, info)


def _parsed(kind: Any, what: str) -> Conv:
    """A defense's settings through its own ``parse`` (the agent flags' and the run config's
    forms alike); ``null`` = off."""
    def conv(v: Any, fail: Fail) -> Any:
        if v is None:
            return None
        try:
            return kind.parse(dict(v) if isinstance(v, Mapping) else v)
        except ValueError:
            fail(what)
            raise
    return conv


@dataclass(frozen=True, config=STRICT)
class PrivacyConfig(Section):
    """Defenses the agents apply to what they send (:mod:`sfl_core.privacy`). A simulation applies
    them to its in-process agents; a deployed agent takes them from its own ``sfl-agent start``
    flags (the device owner decides, and the coordinator needs to know nothing)."""

    nopeek: Annotated[float, checked(nonneg_number)] = 0.0
    activation_noise: Annotated[Optional[ActivationNoise], checked(_parsed(
        ActivationNoise, 'null, {clip: number > 0, sigma: number >= 0} or "CLIP,SIGMA"'))] = None
    withhold_labels: Annotated[bool, BOOLEAN] = False
    """Agents send no labels: the coordinator returns their rows' logits (MergeSFL)."""
    label_protection: Annotated[Optional[LabelProtection], checked(_parsed(
        LabelProtection, "null, max_norm, a number >= 0 (sigma) or {sigma: number >= 0}"))] = None
    """Noise on the logit gradients agents return (needs withhold_labels)."""
    dp_sgd: Annotated[Optional[DpSgd], checked(_parsed(
        DpSgd, 'null, {clip: number > 0, sigma: number > 0, delta: number in (0, 1)} or "CLIP,SIGMA[,DELTA]"'))] = None
    """DP-SGD on the client portion; epsilon (Opacus's accountant) is recorded per round."""

    @model_validator(mode="after")
    def _relations(self) -> "PrivacyConfig":
        try:
            self.agent()
        except ValueError as exc:
            raise invalid("label_protection" if self.label_protection is not None and not self.withhold_labels
                          else "dp_sgd", str(exc))
        if self.dp_sgd is not None:
            try:
                require_accountant()
            except RuntimeError as exc:
                raise invalid("dp_sgd", str(exc))
        return self

    def agent(self) -> AgentPrivacy:
        return AgentPrivacy(self.nopeek, self.activation_noise, withhold_labels=self.withhold_labels,
                            label_protection=self.label_protection, dp_sgd=self.dp_sgd)


@dataclass(frozen=True, config=STRICT)
class RunConfig(Section):
    """One training run. Field meanings are documented at the top of profiles/runs/demo.yaml."""

    YAML_KEYS: ClassVar[Mapping[str, str]] = {"run": "run_id"}

    run_id: Annotated[str, checked(_ident)] = "demo"  # YAML key 'run'; used in MQTT topics, so [A-Za-z0-9_-] only
    model: Annotated[str, checked(_model)] = "small_cnn"
    data: DataConfig = field(default_factory=DataConfig)
    task: Optional[TaskConfig] = None
    """Devices train on their own data (sfl-agent start --data PATH) under this contract; None: the
    built-in data set of ``data``, partitioned over the agents (simulations and benchmarks)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    fleet: tuple[FleetEntry, ...] = ()
    rounds: Annotated[int, POSITIVE_INTEGER] = 5
    per_round: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # agents selected per round; None = all
    min_agents: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # agents to wait for before round 1; None = fleet size
    strategy: Annotated[str, checked(_strategy)] = DEFAULT_STRATEGY
    server_mode: Annotated[str, checked(one_of(*SERVER_MODES))] = "merged"
    split: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # None = the model's default split point
    profile_splits: Annotated[Optional[dict[str, int]], checked(optional(_split_map))] = None
    """FedFC mixed cuts: split per device profile (strategy sfl)."""
    server_weight: Annotated[str, checked(one_of("members", "once"))] = "members"
    """A merged server copy in the layer-wise average: once per member | once."""
    batch_size: Annotated[int, POSITIVE_INTEGER] = 32
    lr: Annotated[float, POSITIVE_NUMBER] = 0.05
    lr_decay: Annotated[float, checked(number_in(0.0, hi=1.0, what="a number in (0, 1]"))] = 1.0
    """Learning rate of round r (from 1) = lr x lr_decay^(r-1), agents and server alike."""
    momentum: Annotated[float, UNIT_OPEN] = 0.0
    local_iters: Annotated[int, POSITIVE_INTEGER] = 10  # tau
    codec: Annotated[str, checked(_codec)] = "fp32"
    zstd_level: Annotated[int, checked(integer_in(0, 22, what="an integer from 0 (no compression) to 22"))] = 3
    seed: Annotated[int, NONNEG_INTEGER] = 0
    server_flops: Annotated[float, POSITIVE_NUMBER] = 5e10
    agent_step_overhead_s: Annotated[float, AT_LEAST_0] = 0.0
    """Coordinator seconds per split agent per local step beyond the server's compute
    (:func:`sfl_core.timing.step_overhead_s`): the virtual clock charges it and the planners
    price with it; ``strategy: auto`` measures it in a deployment."""
    step_timeout_s: Annotated[float, POSITIVE_NUMBER] = 60.0
    register_timeout_s: Annotated[float, POSITIVE_NUMBER] = 300.0
    round_deadline: Annotated[float, AT_LEAST_0] = 4.0
    """A deployed round's deadline, in multiples of its predicted time (the time model's, from
    what its agents measured), never under ``round_deadline_min_s``; 0: no deadline."""
    round_deadline_min_s: Annotated[float, POSITIVE_NUMBER] = 30.0
    busy_timeout_s: Annotated[float, POSITIVE_NUMBER] = 300.0
    """An agent whose heartbeats say busy while nothing it owes arrives for this long is dropped."""
    stragglers: Annotated[str, checked(one_of("continue", "replan"))] = "continue"
    """Past the deadline: drop the late agents and go on with the rest (continue), or drop them
    and plan the round again without them (replan)."""
    min_completed: Annotated[int, POSITIVE_INTEGER] = 1
    """Agents that must complete a round for it to count (at most those selected)."""
    max_registered: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None
    """Most agents the registry holds; None = 2 x the fleet size + 10."""
    register_rate_per_s: Annotated[float, POSITIVE_NUMBER] = 10.0
    """New agent ids accepted per second (burst: the fleet size)."""
    output_dir: Annotated[Optional[str], checked(optional(nonempty_string))] = None  # None -> runs/<run_id>
    eval_samples: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # evaluate on the first N test samples; None = all
    eval_every: Annotated[int, POSITIVE_INTEGER] = 1
    """Score the global model on the server's validation set every this many rounds (and after
    the last); the rounds between record no accuracy. Evaluation is often most of a small
    simulation's time: each round's metrics say how much (``eval_s``)."""
    loss: Annotated[str, checked(one_of(*LOSSES))] = "ce"   # ce | calibrated (FedLC logit calibration, docs/methods/heterosfl.md)
    calibration_tau: Annotated[float, AT_LEAST_0] = 1.0    # calibration strength tau of the calibrated loss
    sections: Mapping[str, Any] = field(default_factory=lambda: {k: s() for k, s in sections().items()})
    """Each method's and training option's own section by YAML key (``s2fl:``, ``drift:``, ...:
    the classes registered in :mod:`sfl_core.method_registry` and :mod:`sfl_core.option_registry`);
    read one with ``SectionClass.of(cfg)``."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    GATHERED: ClassVar[str] = "sections"

    @classmethod
    def gathered_keys(cls) -> list[str]:
        return list(sections())

    @classmethod
    def gather(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Move the method sections' YAML keys into ``sections``, each read by its own class."""
        registered = sections()
        given = dict(data.pop("sections", None) or {})
        given.update({key: data.pop(key) for key in registered if key in data})
        for key in given:
            if key not in registered:
                raise invalid(key, f"no method or option registers a section {key!r} (known: {', '.join(registered)})")
        data["sections"] = {key: given[key] if isinstance(given.get(key), section) else
                            read_section(section, key, given.get(key)) for key, section in registered.items()}
        return data

    def __getattr__(self, name: str) -> Any:
        """``cfg.<section key>``: shorthand for the method's section (bench scripts and tests)."""
        found = self.__dict__.get("sections") or {}
        if name in found:
            return found[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def registry_limit(self) -> int:
        return self.max_registered or 2 * max(self.num_agents, self.min_agents or 0) + 10

    @field_validator("fleet", mode="before")
    @classmethod
    def _fleet_is_a_list(cls, v: Any) -> Any:
        if v is None:
            return ()
        if not isinstance(v, (list, tuple)):
            raise invalid("", f"expected a list of {{profile: NAME, count: N}} entries, got {v!r}")
        return v

    @model_validator(mode="after")
    def _relations(self) -> "RunConfig":
        if self.profile_splits is not None and self.strategy != "sfl":
            raise invalid("profile_splits", f"mixed cut layers need strategy 'sfl' without a bottleneck, "
                                            f"got strategy {self.strategy!r}")
        for section in self.sections.values():
            section.check_run(self)
        if self.task is None and any(e.data is not None for e in self.fleet):
            raise invalid("fleet", "a device's own 'data' needs a 'task' section (its class names and input shape)")
        if self.eval.data is not None and self.task is None:
            raise invalid("eval.data", "a validation set of your own needs a 'task' section (its class names "
                                       "map folders and labels to indices)")
        n = self.num_agents
        if n and self.min_agents is not None and self.min_agents > n:
            raise invalid("min_agents", f"expected at most the fleet size {n}, got {self.min_agents!r}")
        pool = n or self.min_agents or 0
        if self.per_round is not None and pool and self.per_round > pool:
            raise invalid("per_round", f"expected at most {pool} (the number of agents), got {self.per_round!r}")
        return self

    @property
    def num_agents(self) -> int:
        return sum(e.count for e in self.fleet)

    @property
    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.run_id

    def agent_profiles(self) -> list[str]:
        """Profile of every agent index: fleet entries expanded in file order."""
        return [e.profile for e in self.fleet for _ in range(e.count)]

    def agent_data(self) -> list[Optional[str]]:
        """Each agent index's own data path (simulating a task run), as :meth:`agent_profiles`."""
        return [e.data for e in self.fleet for _ in range(e.count)]


# ------------------------------------------------------------------------ loading

_CHECKOUT_PROFILES = Path(__file__).resolve().parents[2] / "profiles"
_PROFILES_PACKAGE = "sfl_profiles"  # profiles/ as the wheel ships it (pyproject.toml)


def _profiles_dir_and_origin() -> tuple[Path, str]:
    env = os.environ.get("SFL_PROFILES_DIR")
    if env:
        return Path(env), "SFL_PROFILES_DIR"
    if _CHECKOUT_PROFILES.is_dir() and (_CHECKOUT_PROFILES.parent / "pyproject.toml").is_file():
        return _CHECKOUT_PROFILES, "source checkout"   # the folder users edit wins over any installed copy
    spec = importlib.util.find_spec(_PROFILES_PACKAGE)   # not importlib.resources.files: Python 3.8 lacks it
    if spec is None or spec.origin is None:
        return _CHECKOUT_PROFILES, "not found"
    return Path(spec.origin).parent, f"installed package {_PROFILES_PACKAGE}"


def default_profiles_dir() -> Path:
    """Where device profiles (``devices/``) and run configs (``runs/``) are read from.

    ``SFL_PROFILES_DIR`` if set (the install scripts' systemd units set it); else the
    checkout's ``profiles/`` when running from a source tree (editable installs too); else the
    copy shipped inside the installed package (``sfl_profiles``, found by ``importlib.util.find_spec``).
    """
    return _profiles_dir_and_origin()[0]


def profiles_origin() -> str:
    """Why :func:`default_profiles_dir` is what it is, for messages: 'SFL_PROFILES_DIR', 'source
    checkout', 'installed package sfl_profiles' or 'not found'."""
    return _profiles_dir_and_origin()[1]


def _search_dirs(search_dirs: Sequence[Path] | None) -> list[Path]:
    if search_dirs is None:
        return [default_profiles_dir() / "devices"]
    return [Path(d) for d in search_dirs]


def list_profiles(search_dirs: Sequence[Path] | None = None) -> list[str]:
    """Names of the profiles found in ``search_dirs`` (file stems), sorted, without repeats."""
    names: set[str] = set()
    for d in _search_dirs(search_dirs):
        if d.is_dir():
            names.update(p.stem for p in d.iterdir() if p.suffix in YAML_SUFFIXES and p.is_file())
    return sorted(names)


def load_profile(name_or_path: str, search_dirs: Sequence[Path] | None = None) -> DeviceProfile:
    """A YAML path, or a name looked up as ``<dir>/<name>.yaml`` (first dir that has it wins)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"<profile>: expected a profile name or path, got {name_or_path!r}")
    if looks_like_path(name_or_path):
        path = Path(name_or_path)
        return profile_from_dict(read_yaml(path), str(path), default_name=path.stem)
    dirs = _search_dirs(search_dirs)
    for d in dirs:
        for suffix in YAML_SUFFIXES:
            path = d / f"{name_or_path}{suffix}"
            if path.is_file():
                prof = profile_from_dict(read_yaml(path), str(path), default_name=name_or_path)
                if prof.name != name_or_path:
                    # Otherwise a fleet entry 'jetson-nano' could silently become another device.
                    raise ConfigError(f"{path}: field 'name': expected {name_or_path!r} "
                                      f"(the file name), got {prof.name!r}")
                return prof
    available = list_profiles(dirs)
    close = difflib.get_close_matches(name_or_path, available, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"{name_or_path}: unknown device profile{hint} (looked in "
        f"{', '.join(str(d) for d in dirs)}; available: {', '.join(available) or 'none'})"
    )


def profile_from_dict(d: Any, source: str = "<dict>", default_name: str | None = None) -> DeviceProfile:
    """Validate a profile mapping (a YAML file's content, one sent by an agent, or a checkpoint's)."""
    if isinstance(d, Mapping) and "name" not in d and default_name is not None:
        d = {**d, "name": default_name}
    return validate(DeviceProfile, d, source)


def run_config_from_dict(d: Any, source: str = "<dict>", base_dir: Path | None = None,
                         search_dirs: Sequence[Path] | None = None) -> RunConfig:
    """Validate a run mapping (YAML keys) and resolve every fleet profile.

    ``base_dir`` anchors relative profile paths in ``fleet`` (the run file's directory).
    """
    if isinstance(d, Mapping) and isinstance(d.get("model"), str) and base_dir is not None:
        from sfl_core.model.user_models import FILE_REF
        ref = FILE_REF.match(d["model"].strip())
        if ref and not Path(ref["path"]).is_absolute():   # a model file sits next to the run file
            d = {**d, "model": str((base_dir / ref["path"]).resolve()) + d["model"].strip()[len(ref["path"]):]}
    cfg = validate(RunConfig, d, source, context={"base_dir": base_dir, "search_dirs": search_dirs})
    if cfg.num_agents == 0 and cfg.min_agents is None:
        raise ConfigError(f"{source}: field 'fleet': expected at least one "
                          f"{{profile: NAME, count: N}} entry (or set 'min_agents' for "
                          f"agents that bring their own profile), got {(d or {}).get('fleet')!r}")
    return cfg


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a run YAML file, resolving every fleet profile (fails early)."""
    path = Path(path)
    return run_config_from_dict(read_yaml(path), str(path), base_dir=path.parent)


def _plain(value: Any) -> Any:
    """A section field as YAML would hold it: tuples as lists, small dataclasses as mappings."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, ActivationNoise):
        return asdict(value)
    return value


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """YAML-keyed plain dict of ``cfg`` (for run records); ``run_config_from_dict`` reads it back."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "task":
            value = value.to_wire() if value is not None else None
        elif f.name == "sections":
            out.update({key: {g.name: _plain(getattr(s, g.name)) for g in fields(s)} for key, s in value.items()})
            continue
        elif f.name in ("data", "eval", "privacy"):
            value = {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
        elif f.name == "fleet":
            value = [{"profile": e.profile, "count": e.count, **({"data": e.data} if e.data else {})} for e in value]
        out["run" if f.name == "run_id" else f.name] = value
    return out
