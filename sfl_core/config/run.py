"""Run configurations: YAML in, a frozen (pydantic) dataclass out, and back to YAML.

The run's core keys are here (:class:`RunConfig`, their checks in :mod:`.core_keys`); its
parts have modules of their own: device profiles (:mod:`.profiles`), the fleet (:mod:`.fleet`),
the core sections (:mod:`.sections`), and each method's and training option's section in its
own folder (:func:`sections`). Everything is re-exported here.

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

from dataclasses import asdict, field, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence

from pydantic import field_validator, model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import (
    STRICT,
    ConfigError,
    Section,
    checked,
    invalid,
    read_section,
    read_yaml,
    validate,
)
from sfl_core.config.values import (
    AT_LEAST_0,
    NONNEG_INTEGER,
    OPTIONAL_POSITIVE_INTEGER,
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    UNIT_OPEN,
    integer_in,
    nonempty_string,
    number_in,
    one_of,
    optional,
)
from sfl_core import method_registry, option_registry
from sfl_core.method_registry import DEFAULT_STRATEGY
from sfl_core.privacy import ActivationNoise
from sfl_core.wire.codec import CODECS
from sfl_core.config.core_keys import _codec, _ident, _model, _strategy, _window
from sfl_core.config.fleet import FleetEntry
from sfl_core.config.profiles import (
    DeviceProfile,
    capacity_scales,
    default_profiles_dir,
    list_profiles,
    load_profile,
    profile_from_dict,
    profiles_origin,
)
from sfl_core.config.sections import PARTITIONS, DataConfig, EvalConfig, PrivacyConfig, TaskConfig, task_from_wire

__all__ = [
    "CODECS",
    "ConfigError",
    "DataConfig",
    "DeviceProfile",
    "EvalConfig",
    "FleetEntry",
    "PARTITIONS",
    "PrivacyConfig",
    "RunConfig",
    "SERVER_MODES",
    "TaskConfig",
    "capacity_scales",
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

SERVER_MODES = ("auto", "merged", "per_agent", "sequential")
"""'merged' = feature merging (one server batch per step); 'per_agent' = SplitFed v1 (a server
copy per agent, averaged); 'sequential' = SplitFed v2 (one server copy, updated agent after agent);
'auto' = merged, except that ``strategy: auto`` decides it from the fleet."""


def sections() -> dict[str, Any]:
    """Every section a run config reads beside its core keys: the methods', then the training
    options', by YAML key."""
    return {**method_registry.sections(), **option_registry.sections()}


# ------------------------------------------------------------------------ field checks
# Each converter takes the raw value and ``fail``; ``fail(what)`` reports "expected <what>".

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
    server_mode: Annotated[str, checked(one_of(*SERVER_MODES))] = "auto"
    split: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None  # None = the model's default split point
    batch_size: Annotated[int, POSITIVE_INTEGER] = 32
    lr: Annotated[float, POSITIVE_NUMBER] = 0.05
    lr_decay: Annotated[float, checked(number_in(0.0, hi=1.0, what="a number in (0, 1]"))] = 1.0
    """Learning rate of round r (from 1) = lr x lr_decay^(r-1), agents and server alike."""
    momentum: Annotated[float, UNIT_OPEN] = 0.0
    local_iters: Annotated[int, POSITIVE_INTEGER] = 10  # tau
    codec: Annotated[str, checked(_codec)] = "fp32"
    window: Annotated[int | str, checked(_window)] = 1
    """Steps a split agent keeps in flight: it computes the next step's activations while the
    last ones travel and the server works, applying each gradient as it arrives, at most
    ``window - 1`` steps stale. 1: lock-step (each step waits for its gradients); up to 16;
    'auto': each agent's smallest window whose predicted round is within 5 % of the fastest
    (1, 2 or 4), priced with its cut, codec and batch. Labels withheld or DP-SGD keep a device at 1."""
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
    sections: Mapping[str, Any] = field(default_factory=lambda: {k: s() for k, s in sections().items()})
    """Each method's and training option's own section by YAML key (``s2fl:``, ``drift:``, ...:
    the classes registered in :mod:`sfl_core.method_registry` and :mod:`sfl_core.option_registry`);
    read one with ``SectionClass.of(cfg)``."""
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    GATHERED: ClassVar[str] = "sections"

    @classmethod
    def gathered_keys(cls) -> list[str]:
        return [*sections(), *(alias for s in sections().values() for alias in s.ALIASES)]

    @classmethod
    def gather(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Move the method sections' YAML keys into ``sections``, each read by its own class."""
        registered = sections()
        given = dict(data.pop("sections", None) or {})
        given.update({key: data.pop(key) for key in registered if key in data})
        for key, section in registered.items():   # a former core key, now a field of its section
            for alias, name in section.ALIASES.items():
                if alias in data:
                    mine = given.get(key)
                    mine = {section.SHORTHAND: mine} if section.SHORTHAND and mine is not None and \
                        not isinstance(mine, Mapping) else dict(mine or {})
                    given[key] = {**mine, name: data.pop(alias)}
        for key in given:
            if key not in registered:
                raise invalid(key, f"no method or option registers a section {key!r} (known: {', '.join(registered)})")
        data["sections"] = {key: given[key] if isinstance(given.get(key), section) else
                            read_section(section, key, given.get(key)) for key, section in registered.items()}
        return data

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
        """Where the run's metrics and checkpoints go: ``output_dir``, else ``runs/<run>``."""
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.run_id

    def agent_profiles(self) -> list[str]:
        """Profile of every agent index: fleet entries expanded in file order."""
        return [e.profile for e in self.fleet for _ in range(e.count)]

    def agent_data(self) -> list[Optional[str]]:
        """Each agent index's own data path (simulating a task run), as :meth:`agent_profiles`."""
        return [e.data for e in self.fleet for _ in range(e.count)]

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
