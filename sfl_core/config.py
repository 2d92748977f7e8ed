"""Device profiles and run configurations: YAML in, frozen dataclasses out.

Why a hand-written validator and not ``yaml.safe_load`` + ``**kwargs``: run files are
written by people, often on a device over SSH, and a typo (``local_iter: 20``) that is
silently ignored costs a whole training run. So every key is checked, every number is
range-checked, and every error names the file, the field path (``fleet[1].count``) and
what was expected. Numbers arrive as strings surprisingly often (PyYAML reads ``5e9`` as a
string because YAML 1.1 floats need a dot), so numeric strings are accepted for numbers.

Nothing here touches the network; loading a run file reads only YAML files.
"""

from __future__ import annotations

import difflib
import importlib.resources
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from sfl_core.fields import (
    YAML_SUFFIXES, ConfigError, Conv, Fail, check_mapping, convert, failer, field_path, looks_like_path, number,
    read_yaml,
)
from sfl_core.partition import SCHEMES
from sfl_core.protocol import check_id
from sfl_core.wire import CODECS, TOPK_PATTERN, is_codec

__all__ = [
    "CODECS",
    "ConfigError",
    "DataConfig",
    "DeviceProfile",
    "FleetEntry",
    "PARTITIONS",
    "RunConfig",
    "SERVER_MODES",
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
"""How the training set is split over agents (docs/methods.md §4)."""


# ------------------------------------------------------------------------ dataclasses

def capacity_scales(capacity: Sequence[Sequence[float]], r: int) -> tuple[float, float]:
    """(compute, link) scale in force in round ``r`` under a capacity schedule (1, 1 before any)."""
    compute, link = 1.0, 1.0
    for from_round, c, l in capacity:
        if r >= from_round:
            compute, link = float(c), float(l)
    return compute, link


def profile_dict_at_round(profile: Mapping[str, Any], r: int) -> dict[str, Any]:
    """A registered profile dict (``protocol.profile_body``) with its ``capacity`` schedule applied."""
    compute, link = capacity_scales(profile.get("capacity") or (), r)
    out = dict(profile)
    out["compute_flops"] = float(profile["compute_flops"]) * compute
    out["link_bytes_per_s"] = float(profile["link_bytes_per_s"]) * link
    out["downlink_bytes_per_s"] = float(profile.get("downlink_bytes_per_s") or profile["link_bytes_per_s"]) * link
    return out


@dataclass(frozen=True)
class DeviceProfile:
    """What the timing model (docs/methods.md §3) needs to know about one kind of device."""

    name: str
    compute_flops: float  # sustained FLOP/s for training (fp32)
    link_bytes_per_s: float  # uplink rate, bytes/s
    downlink_bytes_per_s: float | None = None  # None -> link_bytes_per_s (always a float after init)
    latency_s: float = 0.0  # one-way latency
    memory_bytes: float | None = None
    description: str = ""
    source: str = ""  # where the numbers come from
    capacity: tuple[tuple[int, float, float], ...] = ()
    """Capacity that changes over time, for emulation and simulation: ``(from_round, compute
    scale, link scale)`` entries, ascending; from that round on the device runs at the scaled
    FLOP/s and link rates (e.g. thermal throttling, a congested link)."""

    def __post_init__(self) -> None:
        # Most links are quoted as one number; a symmetric link is the honest default.
        if self.downlink_bytes_per_s is None:
            object.__setattr__(self, "downlink_bytes_per_s", self.link_bytes_per_s)

    def at_round(self, r: int) -> "DeviceProfile":
        """This profile as the device runs in round ``r`` (the latest capacity change in force)."""
        compute, link = capacity_scales(self.capacity, r)
        if (compute, link) == (1.0, 1.0):
            return self
        return replace(self, compute_flops=self.compute_flops * compute, link_bytes_per_s=self.link_bytes_per_s * link,
                       downlink_bytes_per_s=float(self.downlink_bytes_per_s or self.link_bytes_per_s) * link)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (msgpack/YAML friendly); ``profile_from_dict`` reads it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["capacity"] = [{"from_round": r, "compute": c, "link": lk} for r, c, lk in self.capacity]
        return d


@dataclass(frozen=True)
class FleetEntry:
    """``count`` agents of one device profile (a profile name, or an absolute YAML path)."""

    profile: str
    count: int


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"
    root: str | None = None  # relative paths are relative to the working directory
    partition: str = "iid"
    alpha: float = 0.5  # Dirichlet concentration; only used when partition == 'dirichlet'
    seed: int = 0
    image_size: int | None = None  # resize images to image_size x image_size (e.g. 32 for CIFAR-sized models)


@dataclass(frozen=True)
class S2flConfig:
    """S2FL switches (docs/methods.md §5). The paper's ablations: +R = both off (SplitFed v1 at the
    largest candidate split), +B = balance only, +M = sliding only, +MB = both."""

    sliding: bool = True           # adaptive sliding split from the client time table
    balance: bool = True           # data-balance grouping (one server copy per group)
    group_size: int = 5            # agents per group when balancing
    candidates: tuple[int, ...] | None = None   # candidate split points; None = the model's defaults


@dataclass(frozen=True)
class MergeSflConfig:
    """MergeSFL control (docs/methods.md §7): batch-size regulation and KL worker selection under an
    ingress budget, on top of feature merging (``server_mode: merged``)."""

    regulate: bool = False                 # Eq. 9: fastest agent gets max_batch, the others equal time
    max_batch: int | None = None           # D; None = batch_size
    select: bool = False                   # Eq. 10-13: GA picks the agents whose mixed labels are closest to IID
    min_agents: int = 1                    # with select: fewest agents per round (where the budget fits them)
    max_agents: int | None = None          # with select: most agents per round; None = no bound
    min_batch: int = 2                     # smallest regulated batch (batch-norm needs >= 2 samples)
    budget_bytes: float | None = None      # ingress budget per round; None = per_round x batch_size samples
    epsilon: float = 0.01                  # Eq. 14: KL target (nats) of the batch fine-tuning
    smoothing: float = 0.8                 # Eq. 5-6: weight of the previous estimate of mu and beta
    ga_population: int = 60
    ga_generations: int = 100
    ga_crossover: float = 0.9
    ga_mutation: float | None = None       # per-gene flip probability; None = 1/agents


@dataclass(frozen=True)
class HeteroConfig:
    """HeteroSFL (docs/methods.md §6): agents grouped by link rate; each group gets a bottleneck width (and
    optionally its own codec) so the groups' per-step transfer times come out close (the slow
    group compresses most)."""

    width: int | None = None                      # full (widest) width P; None = no bottleneck
    groups: int = 2                               # link-rate groups, 1..4
    widths: tuple[int, ...] | None = None         # fixed width per group, slowest first; None = from the rates
    thresholds: tuple[float, ...] | None = None   # uplink B/s between groups (ascending); None = quantiles
    codecs: tuple[str, ...] | None = None         # codec per group, slowest first; None = the run's codec
    bdks: bool = False                            # bi-directional knowledge sharing for the wider groups
    bdks_alpha: float = 1.0                       # weight of the narrow-to-wide distillation (Eq. 8)
    bdks_theta: float = 0.1                       # under-represented: class share in the group < theta x its share overall


@dataclass(frozen=True)
class RunConfig:
    """One training run. Field meanings are documented at the top of profiles/runs/demo.yaml."""

    run_id: str = "demo"  # YAML key 'run'; used in MQTT topics, so [A-Za-z0-9_-] only
    model: str = "small_cnn"
    data: DataConfig = field(default_factory=DataConfig)
    fleet: tuple[FleetEntry, ...] = ()
    rounds: int = 5
    per_round: int | None = None  # agents selected per round; None = all
    min_agents: int | None = None  # agents to wait for before round 1; None = fleet size
    strategy: str = "sfl"
    server_mode: str = "merged"
    split: int | None = None  # None = the model's default split point
    profile_splits: dict[str, int] | None = None  # FedFC mixed cuts: split per device profile (strategy sfl)
    server_weight: str = "members"  # a merged server copy in the layer-wise average: once per member | once
    batch_size: int = 32
    lr: float = 0.05
    lr_decay: float = 1.0  # learning rate of round r (from 1) = lr x lr_decay^(r-1), agents and server alike
    momentum: float = 0.0
    local_iters: int = 10  # tau
    codec: str = "fp32"
    zstd_level: int = 3
    seed: int = 0
    server_flops: float = 5e10
    step_timeout_s: float = 60.0
    register_timeout_s: float = 300.0
    output_dir: str | None = None  # None -> runs/<run_id>
    eval_samples: int | None = None  # evaluate on the first N test samples; None = all
    loss: str = "ce"               # ce | calibrated (FedLC logit calibration, docs/methods.md §6)
    calibration_tau: float = 1.0   # calibration strength tau of the calibrated loss
    s2fl: S2flConfig = field(default_factory=S2flConfig)
    hetero: HeteroConfig = field(default_factory=HeteroConfig)
    mergesfl: MergeSflConfig = field(default_factory=MergeSflConfig)

    @property
    def num_agents(self) -> int:
        return sum(e.count for e in self.fleet)

    @property
    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.run_id

    def agent_profiles(self) -> list[str]:
        """Profile of every agent index: fleet entries expanded in file order."""
        return [e.profile for e in self.fleet for _ in range(e.count)]


# ------------------------------------------------------------------------ field checks



def _float(lo: float | None = None, lo_open: bool = True, hi: float | None = None,
           hi_open: bool = False, what: str = "a number") -> Conv:
    def conv(v: Any, fail: Fail) -> float:
        x = number(v)
        if x is None:
            fail(what)
        x = float(x)
        if lo is not None and (x < lo or (lo_open and x == lo)):
            fail(what)
        if hi is not None and (x > hi or (hi_open and x == hi)):
            fail(what)
        return x
    return conv


def _int(lo: int, hi: int | None = None, what: str = "an integer") -> Conv:
    def conv(v: Any, fail: Fail) -> int:
        x = number(v)
        if x is None or (isinstance(x, float) and not x.is_integer()):
            fail(what)
        x = int(x)
        if x < lo or (hi is not None and x > hi):
            fail(what)
        return x
    return conv


_pos_float = _float(0.0, what="a positive number")
_nonneg_float = _float(0.0, lo_open=False, what="a non-negative number")
_pos_int = _int(1, what="a positive integer")
_nonneg_int = _int(0, what="a non-negative integer")


def _str(v: Any, fail: Fail) -> str:
    if not isinstance(v, str) or not v.strip():
        fail("a non-empty string")
    return v


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


def _enum(*choices: str) -> Conv:
    def conv(v: Any, fail: Fail) -> str:
        if v not in choices:
            fail("one of " + ", ".join(repr(c) for c in choices))
        return v
    return conv


def _strategy(v: Any, fail: Fail) -> str:
    """A built-in strategy or one registered with :func:`sfl_core.methods.register_method`."""
    from sfl_core.methods import strategies   # late: the methods read RunConfig
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


def _opt(conv: Conv) -> Conv:
    """``None`` (YAML ``null`` or ``~``) means 'use the automatic value'."""
    def wrapped(v: Any, fail: Fail) -> Any:
        return None if v is None else conv(v, fail)
    return wrapped




# ------------------------------------------------------------------------ YAML reading




# ------------------------------------------------------------------------ device profiles

def _capacity(v: Any, fail: Fail) -> tuple[tuple[int, float, float], ...]:
    what = ("a list of {from_round: R >= 1, compute: scale > 0, link: scale > 0} with rounds ascending")
    if v is None:
        return ()
    if not isinstance(v, list):
        fail(what)
    out = []
    for e in v:
        if not isinstance(e, dict) or set(e) - {"from_round", "compute", "link"} or "from_round" not in e:
            fail(what)
        r, c, l = e["from_round"], number(e.get("compute", 1.0)), number(e.get("link", 1.0))
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or c is None or l is None or c <= 0 or l <= 0:
            fail(what)
        out.append((r, float(c), float(l)))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        fail(what)
    return tuple(out)


_PROFILE_SPEC: dict[str, Conv] = {
    "name": _str,
    "compute_flops": _pos_float,
    "link_bytes_per_s": _pos_float,
    "downlink_bytes_per_s": _opt(_pos_float),
    "latency_s": _nonneg_float,
    "memory_bytes": _opt(_pos_float),
    "description": _text,
    "source": _text,
    "capacity": _capacity,
}
_PROFILE_REQUIRED = ("compute_flops", "link_bytes_per_s")


_CHECKOUT_PROFILES = Path(__file__).resolve().parent.parent / "profiles"
_PROFILES_PACKAGE = "sfl_profiles"  # profiles/ as the wheel ships it (pyproject.toml)


def _profiles_dir_and_origin() -> tuple[Path, str]:
    env = os.environ.get("SFL_PROFILES_DIR")
    if env:
        return Path(env), "SFL_PROFILES_DIR"
    if _CHECKOUT_PROFILES.is_dir() and (_CHECKOUT_PROFILES.parent / "pyproject.toml").is_file():
        return _CHECKOUT_PROFILES, "source checkout"   # the folder users edit wins over any installed copy
    try:
        packaged = importlib.resources.files(_PROFILES_PACKAGE)
    except ModuleNotFoundError:
        return _CHECKOUT_PROFILES, "not found"
    return Path(str(packaged)), f"installed package {_PROFILES_PACKAGE}"


def default_profiles_dir() -> Path:
    """Where device profiles (``devices/``) and run configs (``runs/``) are read from.

    ``SFL_PROFILES_DIR`` if set (the install scripts' systemd units set it); else the
    checkout's ``profiles/`` when running from a source tree (editable installs too); else the
    copy shipped inside the installed package (``sfl_profiles``, via ``importlib.resources``).
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


def profile_from_dict(d: Any, source: str = "<dict>", default_name: str | None = None) -> DeviceProfile:
    """Validate a profile mapping (a YAML file's content, or one sent by an agent)."""
    d = check_mapping({} if d is None else d, list(_PROFILE_SPEC), source, "")
    for key in _PROFILE_REQUIRED:
        if key not in d:
            raise ConfigError(f"{source}: field '{key}': expected a positive number, but it is missing")
    values = convert(d, _PROFILE_SPEC, source, "")
    if "name" not in values:
        if default_name is None:
            raise ConfigError(f"{source}: field 'name': expected a non-empty string, but it is missing")
        values["name"] = default_name
    return DeviceProfile(**values)




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


# ------------------------------------------------------------------------ run configs

_DATA_SPEC: dict[str, Conv] = {
    "dataset": _str,
    "root": _opt(_str),
    "partition": _enum(*PARTITIONS),
    "alpha": _pos_float,
    "seed": _nonneg_int,
    "image_size": _opt(_pos_int),
}

_RUN_SPEC: dict[str, Conv] = {
    "run": _ident,
    "model": lambda v, fail: _model(v, fail),
    "data": lambda v, fail: v,  # checked by _data()
    "fleet": lambda v, fail: v,  # checked by _fleet()
    "rounds": _pos_int,
    "per_round": _opt(_pos_int),
    "min_agents": _opt(_pos_int),
    "strategy": _strategy,
    "server_mode": _enum(*SERVER_MODES),
    "split": _opt(_pos_int),
    "profile_splits": _opt(_split_map),
    "server_weight": _enum("members", "once"),
    "batch_size": _pos_int,
    "lr": _pos_float,
    "lr_decay": _float(0.0, hi=1.0, what="a number in (0, 1]"),
    "momentum": _float(0.0, lo_open=False, hi=1.0, hi_open=True, what="a number in [0, 1)"),
    "local_iters": _pos_int,
    "codec": _codec,
    "zstd_level": _int(0, 22, what="an integer from 0 (no compression) to 22"),
    "seed": _nonneg_int,
    "server_flops": _pos_float,
    "step_timeout_s": _pos_float,
    "register_timeout_s": _pos_float,
    "output_dir": _opt(_str),
    "eval_samples": _opt(_pos_int),
    "loss": _enum(*LOSSES),
    "calibration_tau": _float(0.0, lo_open=False, what="a number >= 0"),
    "s2fl": lambda v, fail: v,  # checked by _s2fl()
    "mergesfl": lambda v, fail: v,  # checked by _mergesfl()
    "hetero": lambda v, fail: v,  # checked by _hetero()
}
_YAML_TO_ATTR = {"run": "run_id"}


def _model(v: Any, fail: Fail) -> str:
    """A zoo model name, a spec string (``vgg16:width=0.25,norm=group``) or a mapping
    ``{name: vgg16, width: 0.25, norm: group}``; stored as the canonical spec string."""
    from sfl_core.models import ModelSpec   # torch is only needed once a model is named

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


def _bool(v: Any, fail: Fail) -> bool:
    if not isinstance(v, bool):
        fail("true or false")
    return v


def _split_list(v: Any, fail: Fail) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        fail("a non-empty list of split points (integers >= 1), or null")
    if sorted(set(v)) != v:
        fail("strictly increasing split points")
    return tuple(v)


_S2FL_SPEC: dict[str, Conv] = {
    "sliding": _bool,
    "balance": _bool,
    "group_size": _pos_int,
    "candidates": _split_list,
}


_MERGESFL_SPEC: dict[str, Conv] = {
    "regulate": _bool,
    "max_batch": _opt(_int(1, 4096, what="an integer from 1 to 4096")),
    "select": _bool,
    "min_agents": _pos_int,
    "max_agents": _opt(_pos_int),
    "min_batch": _int(1, 4096, what="an integer from 1 to 4096"),
    "budget_bytes": _opt(_pos_float),
    "epsilon": _float(0.0, lo_open=False, what="a number >= 0"),
    "smoothing": _float(0.0, lo_open=False, hi=1.0, hi_open=True, what="a number in [0, 1)"),
    "ga_population": _int(2, 10_000, what="an integer from 2 to 10000"),
    "ga_generations": _int(1, 100_000, what="an integer from 1 to 100000"),
    "ga_crossover": _float(0.0, lo_open=False, hi=1.0, what="a number in [0, 1]"),
    "ga_mutation": _opt(_float(0.0, lo_open=False, hi=1.0, what="a number in [0, 1]")),
}


def _mergesfl(v: Any, source: str) -> MergeSflConfig:
    d = check_mapping({} if v is None else v, list(_MERGESFL_SPEC), source, "mergesfl")
    return MergeSflConfig(**convert(d, _MERGESFL_SPEC, source, "mergesfl"))


def _s2fl(v: Any, source: str) -> S2flConfig:
    d = check_mapping({} if v is None else v, list(_S2FL_SPEC), source, "s2fl")
    return S2flConfig(**convert(d, _S2FL_SPEC, source, "s2fl"))


def _pos_int_list(v: Any, fail: Fail) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        fail("a non-empty list of positive integers, or null")
    return tuple(v)


def _rate_list(v: Any, fail: Fail) -> tuple[float, ...] | None:
    if v is None:
        return None
    nums = [number(x) for x in v] if isinstance(v, list) else None
    if not nums or any(x is None or x <= 0 for x in nums) or any(b <= a for a, b in zip(nums, nums[1:])):
        fail("a strictly ascending list of positive rates in bytes/s, or null")
    return tuple(float(x) for x in nums)


def _codec_list(v: Any, fail: Fail) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(is_codec(c) for c in v):
        fail("a non-empty list of codecs (" + ", ".join(CODECS) + f" or {TOPK_PATTERN}), or null")
    return tuple(v)


_HETERO_SPEC: dict[str, Conv] = {
    "width": _opt(_pos_int),
    "groups": _int(1, 4, what="an integer from 1 to 4"),
    "widths": _pos_int_list,
    "thresholds": _rate_list,
    "codecs": _codec_list,
    "bdks": _bool,
    "bdks_alpha": _float(0.0, lo_open=False, what="a number >= 0"),
    "bdks_theta": _float(0.0, lo_open=False, hi=1.0, hi_open=False, what="a number in [0, 1]"),
}


def _hetero(v: Any, source: str) -> HeteroConfig:
    d = check_mapping({} if v is None else v, list(_HETERO_SPEC), source, "hetero")
    cfg = HeteroConfig(**convert(d, _HETERO_SPEC, source, "hetero"))
    if cfg.codecs is not None and len(cfg.codecs) != cfg.groups:
        raise ConfigError(f"{source}: field 'hetero.codecs': expected {cfg.groups} codecs (one per group), "
                          f"got {list(cfg.codecs)}")
    if cfg.widths is not None and len(cfg.widths) != cfg.groups:
        raise ConfigError(f"{source}: field 'hetero.widths': expected {cfg.groups} widths (one per group), "
                          f"got {list(cfg.widths)}")
    if cfg.widths is not None and cfg.width is None:
        raise ConfigError(f"{source}: field 'hetero.widths': fixed widths need the full width (set hetero.width)")
    if cfg.widths is not None and any(b < a for a, b in zip(cfg.widths, cfg.widths[1:])):
        raise ConfigError(f"{source}: field 'hetero.widths': expected widths non-decreasing from the slowest "
                          f"group, got {list(cfg.widths)}")
    if cfg.widths is not None and max(cfg.widths) > cfg.width:
        raise ConfigError(f"{source}: field 'hetero.widths': expected widths <= hetero.width {cfg.width}")
    if cfg.thresholds is not None and len(cfg.thresholds) != cfg.groups - 1:
        raise ConfigError(f"{source}: field 'hetero.thresholds': expected {cfg.groups - 1} rates "
                          f"(between {cfg.groups} groups), got {list(cfg.thresholds)}")
    return cfg


def _data(v: Any, source: str) -> DataConfig:
    d = check_mapping({} if v is None else v, list(_DATA_SPEC), source, "data")
    return DataConfig(**convert(d, _DATA_SPEC, source, "data"))


def _resolve_profile_path(p: str, base_dir: Path | None) -> str:
    """Relative profile paths: next to the run file first, then the working directory."""
    path = Path(p)
    if path.is_absolute():
        return str(path)
    if base_dir is not None and (base_dir / path).is_file():
        return str((base_dir / path).resolve())
    return str(path.resolve())


def _fleet(v: Any, source: str, base_dir: Path | None,
           search_dirs: Sequence[Path] | None) -> tuple[FleetEntry, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(f"{source}: field 'fleet': expected a list of "
                          f"{{profile: NAME, count: N}} entries, got {v!r}")
    entries = []
    for i, item in enumerate(v):
        prefix = f"fleet[{i}]"
        if isinstance(item, str):  # shorthand: '- jetson-nano' means one agent
            item = {"profile": item}
        d = check_mapping(item, ["profile", "count"], source, prefix)
        if "profile" not in d:
            raise ConfigError(f"{source}: field '{prefix}.profile': expected a device profile "
                              f"name or YAML path, but it is missing")
        name = _str(d["profile"], failer(source, f"{prefix}.profile", d["profile"]))
        count = _pos_int(d.get("count", 1), failer(source, f"{prefix}.count", d.get("count")))
        if looks_like_path(name):
            name = _resolve_profile_path(name, base_dir)
        try:
            load_profile(name, search_dirs)  # fail now, not when agent 37 starts
        except ConfigError as exc:
            raise ConfigError(f"{source}: field '{prefix}.profile': expected a known device "
                              f"profile: {exc}") from None
        entries.append(FleetEntry(profile=name, count=count))
    return tuple(entries)


def run_config_from_dict(d: Any, source: str = "<dict>", base_dir: Path | None = None,
                         search_dirs: Sequence[Path] | None = None) -> RunConfig:
    """Validate a run mapping (YAML keys) and resolve every fleet profile.

    ``base_dir`` anchors relative profile paths in ``fleet`` (the run file's directory).
    """
    d = check_mapping({} if d is None else d, list(_RUN_SPEC), source, "")
    values = convert(d, _RUN_SPEC, source, "")
    kwargs: dict[str, Any] = {_YAML_TO_ATTR.get(k, k): v for k, v in values.items()}
    kwargs["data"] = _data(d.get("data"), source)
    kwargs["s2fl"] = _s2fl(d.get("s2fl"), source)
    kwargs["mergesfl"] = _mergesfl(d.get("mergesfl"), source)
    kwargs["hetero"] = _hetero(d.get("hetero"), source)
    kwargs["fleet"] = _fleet(d.get("fleet"), source, base_dir, search_dirs)
    cfg = RunConfig(**kwargs)

    if cfg.profile_splits is not None and (cfg.strategy != "sfl" or cfg.hetero.width is not None):
        raise ConfigError(f"{source}: field 'profile_splits': mixed cut layers need strategy 'sfl' without a "
                          f"bottleneck, got strategy {cfg.strategy!r}")
    m = cfg.mergesfl
    if (m.regulate or m.select) and cfg.strategy == "fedavg":
        raise ConfigError(f"{source}: field 'mergesfl': batch regulation and worker selection need split "
                          f"training (strategy sfl or s2fl), got strategy 'fedavg'")
    if m.max_batch is not None and m.max_batch < cfg.batch_size:
        raise ConfigError(f"{source}: field 'mergesfl.max_batch': expected at least batch_size "
                          f"{cfg.batch_size}, got {m.max_batch}")
    if m.max_agents is not None and m.max_agents < m.min_agents:
        raise ConfigError(f"{source}: field 'mergesfl.max_agents': expected at least mergesfl.min_agents "
                          f"{m.min_agents}, got {m.max_agents}")
    if m.min_batch > (m.max_batch or cfg.batch_size):
        raise ConfigError(f"{source}: field 'mergesfl.min_batch': expected at most max_batch "
                          f"{m.max_batch or cfg.batch_size}, got {m.min_batch}")
    if cfg.hetero.bdks and cfg.hetero.width is None:
        raise ConfigError(f"{source}: field 'hetero.bdks': needs a bottleneck (set hetero.width)")
    if cfg.hetero.width is not None and (cfg.strategy == "fedavg" or
                                             (cfg.strategy == "s2fl" and cfg.s2fl.sliding)):
        raise ConfigError(f"{source}: field 'hetero.width': a bottleneck needs one fixed split point "
                          f"(strategy sfl, or s2fl with sliding false), got strategy {cfg.strategy!r}")
    n = cfg.num_agents
    if n == 0 and cfg.min_agents is None:
        raise ConfigError(f"{source}: field 'fleet': expected at least one "
                          f"{{profile: NAME, count: N}} entry (or set 'min_agents' for "
                          f"agents that bring their own profile), got {d.get('fleet')!r}")
    if n and cfg.min_agents is not None and cfg.min_agents > n:
        raise ConfigError(f"{source}: field 'min_agents': expected at most the fleet size "
                          f"{n}, got {cfg.min_agents!r}")
    pool = n or cfg.min_agents or 0
    if cfg.per_round is not None and cfg.per_round > pool:
        raise ConfigError(f"{source}: field 'per_round': expected at most {pool} "
                          f"(the number of agents), got {cfg.per_round!r}")
    return cfg


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a run YAML file, resolving every fleet profile (fails early)."""
    path = Path(path)
    return run_config_from_dict(read_yaml(path), str(path), base_dir=path.parent)


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """YAML-keyed plain dict of ``cfg`` (for run records); ``run_config_from_dict`` reads it back."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("data", "s2fl", "hetero", "mergesfl"):
            value = {g.name: (list(getattr(value, g.name)) if isinstance(getattr(value, g.name), tuple)
                              else getattr(value, g.name)) for g in fields(value)}
        elif f.name == "fleet":
            value = [{"profile": e.profile, "count": e.count} for e in value]
        out["run" if f.name == "run_id" else f.name] = value
    return out
