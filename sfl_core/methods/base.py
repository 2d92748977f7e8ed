"""The method seam: what a split-learning method decides each round, and what it learns back.

The round engine (``coordinator.engine``) runs any method the same way:

1. ``select`` — which of the online agents train this round, and their batch sizes;
2. ``plan`` — per agent the split point, bottleneck width and codec, and how the server
   groups the agents' activations (one merged batch, one copy per agent, ...);
3. the engine assigns, runs the steps, aggregates and evaluates;
4. ``observe`` / ``record`` — each agent's measured (or simulated) times and bytes come back,
   so the next round's plan can react.

A method is a base (where the model is cut: :mod:`.fedavg`, :mod:`.sfl`, :mod:`.fedfc`,
:mod:`.s2fl`) plus optional layers that refine its decisions (:mod:`.heterosfl` adds widths
and codecs, :mod:`.mergesfl` selection and batch sizes). A layer wraps a method and
delegates what it does not change, so layers compose with every base.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence

from sfl_core.config.run import DeviceProfile, RunConfig
from sfl_core.estimates import ClientTimeTable, FleetEstimates
from sfl_core.fleet import AgentInfo
from sfl_core.losses import LossSpec
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel


@dataclass(frozen=True)
class RoundPlan:
    splits: dict[str, int]
    """Per agent its cut; the model's ``num_blocks`` puts the whole model on the agent (it trains
    locally and sends only its weights, FedAvg-style), and agents of both kinds may share a round."""
    groups: list[list[str]]
    phase: str = ""
    """How the splits were chosen: fixed, warm-up, median rule."""
    widths: dict[str, int] = field(default_factory=dict)
    """Bottleneck width per agent (absent or 0 = no bottleneck)."""
    codecs: dict[str, str] = field(default_factory=dict)
    """Wire codec per agent (absent = the run's codec)."""
    windows: dict[str, int] = field(default_factory=dict)
    """Steps in flight per agent (absent = the run's ``window``, 'auto' priced by the engine)."""
    sequential: bool = False
    """SplitFed v2: each group's server copy trains on its members one after another."""
    server_once: bool = False
    """FedFC Alg. 3: a group's server copy counts once in the layer-wise average, not once per member."""


def resolved_split(cfg: RunConfig, model: SplitModel) -> int:
    """The run's one cut: its ``split``, else the model's default (the one place that decides it)."""
    return cfg.split or model.default_split


def split_plan(cfg: RunConfig, splits: Mapping[str, int], phase: str, **extra: Any) -> RoundPlan:
    """A plan whose server side follows ``cfg.server_mode`` (merged, and auto where the method
    has not decided it: one copy for all; per_agent: one copy each; sequential: one copy, agent
    after agent)."""
    ids = sorted(splits)
    groups = [[a] for a in ids] if cfg.server_mode == "per_agent" else [ids]
    return RoundPlan(dict(splits), groups, phase, sequential=cfg.server_mode == "sequential", **extra)


@dataclass(frozen=True)
class AgentRound:
    """What one agent's finished round tells the method (the engine's measurements, by the run's clock)."""

    agent_id: str
    info: AgentInfo
    split: int
    codec: str
    samples: int
    """``tau x batch``."""
    compute_s: float
    transfer_s: float
    """Client compute and link seconds of the round."""
    profile: DeviceProfile
    """The agent's device profile at this round (capacity schedules applied): the rates the clock charged."""
    weights_bytes: float
    """Encoded size of the agent's weights upload."""
    messages: int
    wire_bytes: float
    fp32_bytes: float
    """What the round's traffic would have been in plain fp32 (the compression ratio's denominator)."""
    step_jitter_s: float = 0.0
    """Standard deviation of its per-step response times as a wall clock saw them (0 by the time model)."""
    weights_phase_s: float = 0.0
    """Its client portion's download and upload as a wall clock saw them (0 by the time model)."""
    step_bytes: tuple[int, int] = (0, 0)
    """The encoded bytes of its activations and of its gradients (how the steps' traffic divides)."""


class Method:
    """A method's decisions; the base class is vanilla behaviour for every hook.

    Subclasses override what they decide. The engine reads only these attributes, never
    a method's name. State that must survive a restart goes through :meth:`to_json` /
    :meth:`load_json` (the checkpoint's ``state.json``).
    """

    TRAINS_WHOLE_MODEL: ClassVar[bool] = False
    """The whole model trains on the agent (nothing is split): split-only settings do not apply."""

    @classmethod
    def for_run(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> "Method":
        """The method ``strategy:`` builds for ``cfg`` (a subclass may pick a variant)."""
        return cls(cfg, model, costs)

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        """Why this method does not keep every agent at one fixed split, which a bottleneck
        (an encoder/decoder pair at the cut) needs; None when it does."""
        return (f"a bottleneck needs one fixed split point for every agent, which strategy "
                f"{cfg.strategy!r} does not keep")

    @classmethod
    def prepare_model(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> None:
        """Give the run's global model what this method trains beyond the zoo model (a
        bottleneck at the cut), before any round; called for the base method and every layer
        the config asks for (:func:`sfl_core.method_registry.prepare_model`)."""
        return None

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        """``sfl-coord plan``'s comparison: this method's runs of ``base`` (the user's config with
        every method's own switches off), by the name the table shows; none by default."""
        return {}

    @classmethod
    def plan_notes(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost],
                   rows: Sequence[Any]) -> list[tuple[str, str]]:
        """``sfl-coord plan``'s remarks under the comparison (``rows``: every method's
        :class:`~sfl_core.methods.preview.MethodPreview`), as (text, style) lines; none by default."""
        return []

    def __init__(self, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]):
        self.cfg = cfg
        self.model = model
        self.costs = costs
        self.fleet = FleetEstimates()
        """What the method knows of each agent's speed (shared with every layer on top of it)."""

    @property
    def time_table(self) -> ClientTimeTable:
        """Measured and estimated round seconds per (agent, split): S2FL's Table, kept for every method."""
        return self.fleet.time_table

    @time_table.setter
    def time_table(self, table: ClientTimeTable) -> None:
        self.fleet.time_table = table

    @property
    def wire_ratio(self) -> dict[str, float]:
        """Measured wire bytes / fp32 bytes per ``"<split>/<codec>"`` (smoothed)."""
        return self.fleet.wire_ratio

    @wire_ratio.setter
    def wire_ratio(self, ratios: dict[str, float]) -> None:
        self.fleet.wire_ratio = ratios

    @property
    def up_share(self) -> dict[str, float]:
        """Measured share of the steps' wire bytes going up per ``"<split>/<codec>"`` (smoothed)."""
        return self.fleet.up_share

    # ----------------------------------------------------------------- what the run trains
    @property
    def candidates(self) -> tuple[int, ...]:
        """The split points the method chooses among each round (empty: it does not choose)."""
        return ()

    @property
    def configured_splits(self) -> tuple[int, ...]:
        """The cuts the run was told to train at (none where the method picks them), for the
        start-of-run check that none of them sends far more bytes than it needs to."""
        return ()

    def splits_to_time(self) -> list[int]:
        """The split points the agents should time at registration: the ones they can be assigned."""
        return list(self.candidates) or [resolved_split(self.cfg, self.model)]

    def notes(self, pool: int) -> list[str]:
        """Lines a run starts with (what a user must know about how the method reads the config)."""
        return []

    # ----------------------------------------------------------------- one round
    def selects_everyone(self, r: int) -> bool:
        """Round ``r`` trains every online agent, not a sample of ``per_round``."""
        return False

    def uniform_sample(self, r: int, online: Sequence[str]) -> list[str]:
        """``per_round`` of the ``online`` agents drawn uniformly, seeded per round so a resumed run
        draws the same; all of them where the method trains everyone this round."""
        if self.selects_everyone(r):
            return list(online)
        k = min(self.cfg.per_round or len(online), len(online))
        return sorted(random.Random(self.cfg.seed * 100_003 + r).sample(list(online), k))

    def select(self, r: int, online: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        """The round's agents and their batch sizes (empty: the run's ``batch_size``).
        ``default`` is :meth:`uniform_sample`'s draw."""
        return list(default), {}

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        raise NotImplementedError

    def lr(self, batch: int | None) -> float:
        """An agent's learning rate for a batch of ``batch`` samples (``None``: the run's batch)."""
        return self.cfg.lr

    def aggregation_weight(self, info: AgentInfo, batch_size: int) -> float:
        """An agent's weight in the layer-wise average: its data size."""
        return float(info.num_samples)

    def round_metrics(self) -> dict[str, Any]:
        """Extra keys of the round's metrics record (what the method decided, for the curves)."""
        return {}

    def server_loss(self) -> LossSpec:
        """How the server scores the rows it trains on: the run's ``loss`` by default."""
        return LossSpec()

    def learning(self, r: int, agents: Optional[Mapping[str, AgentInfo]],
                 accuracy: Sequence[float], *, shared_server: bool = False) -> tuple[RunConfig, list[str]]:
        """The run config round ``r`` trains with: ``self.cfg`` with the training options (and
        the ``server_mode: auto``) the method decides for the run, those its config leaves to it,
        and one line per decision that changed. ``agents``: the registered fleet; None: no new
        evidence, the decisions so far (a resumed run). ``accuracy``: the scored rounds'
        validation accuracy so far. ``shared_server``: several server workers share the rounds
        (no sequential server copy). By default the config as written, and nothing to say."""
        return self.cfg, []

    def use_config(self, cfg: RunConfig) -> None:
        """Plan with ``cfg`` from now on (the config :meth:`learning` settled)."""
        self.cfg = cfg

    # ----------------------------------------------------------------- what comes back
    def observe(self, rounds: Sequence[AgentRound]) -> None:
        """The round's finished agents: fold the bytes into the compression ratio per split and
        codec, and the share of the steps' bytes going up (:attr:`up_share`)."""
        for a in rounds:
            if a.fp32_bytes <= 0 or a.wire_bytes <= 0:
                continue
            key, ratio = f"{a.split}/{a.codec}", a.wire_bytes / a.fp32_bytes
            old = self.wire_ratio.get(key)
            self.wire_ratio[key] = ratio if old is None else 0.8 * old + 0.2 * ratio
            if sum(a.step_bytes) > 0:   # the share going up: a window's bound is the busier direction
                share = a.step_bytes[0] / sum(a.step_bytes)
                old = self.up_share.get(key)
                self.up_share[key] = share if old is None else 0.8 * old + 0.2 * share

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int],
               round_s: float | None = None) -> None:
        """The round's measured times per agent (after :meth:`observe`), and the round's own
        duration by the run's clock (a deployment's: its wall seconds, coordinator included)."""

    # ----------------------------------------------------------------- checkpoint
    def to_json(self) -> dict[str, Any]:
        return {"time_table": self.time_table.to_json(), "candidates": list(self.candidates),
                "wire_ratio": dict(self.wire_ratio), "up_share": dict(self.up_share)}

    def load_json(self, st: Mapping[str, Any]) -> None:
        """Restore from a checkpoint's state (keys this method never wrote are ignored)."""
        if st.get("time_table"):
            self.time_table = ClientTimeTable.from_json(st["time_table"])
        self.wire_ratio = {str(k): float(v) for k, v in st.get("wire_ratio", {}).items()}
        self.fleet.up_share = {str(k): float(v) for k, v in st.get("up_share", {}).items()}


class Layer(Method):
    """A method that refines another one's decisions; everything it does not override is the inner method's."""

    def __init__(self, inner: Method):
        # no Method.__init__: the settings and estimates are the inner method's, one copy for all layers
        self.inner = inner
        self.cfg, self.model, self.costs = inner.cfg, inner.model, inner.costs

    @staticmethod
    def wanted(cfg: RunConfig) -> bool:
        """Whether the run config asks for this layer."""
        raise NotImplementedError

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        """A layer keeps its inner method's cuts unless it says otherwise."""
        return None

    @property
    def fleet(self) -> FleetEstimates:  # type: ignore[override]
        return self.inner.fleet

    @property
    def candidates(self) -> tuple[int, ...]:
        return self.inner.candidates

    @property
    def configured_splits(self) -> tuple[int, ...]:
        return self.inner.configured_splits

    def splits_to_time(self) -> list[int]:
        return self.inner.splits_to_time()

    def notes(self, pool: int) -> list[str]:
        return self.inner.notes(pool)

    def selects_everyone(self, r: int) -> bool:
        return self.inner.selects_everyone(r)

    def select(self, r: int, online: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        return self.inner.select(r, online, agents, default)

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return self.inner.plan(r, selected, agents)

    def lr(self, batch: int | None) -> float:
        return self.inner.lr(batch)

    def aggregation_weight(self, info: AgentInfo, batch_size: int) -> float:
        return self.inner.aggregation_weight(info, batch_size)

    def round_metrics(self) -> dict[str, Any]:
        return self.inner.round_metrics()

    def server_loss(self) -> LossSpec:
        return self.inner.server_loss()

    def learning(self, r: int, agents: Optional[Mapping[str, AgentInfo]],
                 accuracy: Sequence[float], *, shared_server: bool = False) -> tuple[RunConfig, list[str]]:
        return self.inner.learning(r, agents, accuracy, shared_server=shared_server)

    def use_config(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.inner.use_config(cfg)

    def observe(self, rounds: Sequence[AgentRound]) -> None:
        self.inner.observe(rounds)

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int],
               round_s: float | None = None) -> None:
        self.inner.record(r, times, splits, round_s)

    def to_json(self) -> dict[str, Any]:
        return self.inner.to_json()

    def load_json(self, st: Mapping[str, Any]) -> None:
        self.inner.load_json(st)
