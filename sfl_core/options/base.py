"""The option seam: what a training option adds to a round, beside the method that plans it.

A method decides who trains, where the model is cut and how the server groups the rows
(:mod:`sfl_core.methods.base`). A training option changes *how* the planned round trains and
what it delivers: a term in every local step (drift correction), how the aggregate becomes the
new model (a server optimiser), a phase after aggregation (a statistics pass), the model the
run delivers (an average over rounds). The round engine (``coordinator.engine``) runs every
option of a run through the hooks of :class:`RoundOption`, in registration order, and never
names one; the agent (``edge_agent.agent``) runs each option's :class:`DeviceOption`.

An option is one folder, ``sfl_core/options/<name>/``:

- ``config.py``: its run-config section (an :class:`~sfl_core.config.section.OptionSection`,
  validated by itself, one-line errors naming the YAML key);
- ``option.py``: the :class:`RoundOption` subclass: the engine's hooks, the fields it adds to
  an assignment (:attr:`RoundOption.ASSIGN_FIELDS`, typed and validated on both sides), its
  checkpoint state and its cost in the time model;
- what else it needs (its mathematics, its messages).

It is registered by name in :mod:`sfl_core.option_registry` (or an installed package's entry
point): nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence

import torch

from sfl_core.wire.protocol import in_range   # the range checks of every message field

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.config.section import OptionSection
    from sfl_core.evidence import Evidence
    from sfl_core.fleet import AgentInfo
    from sfl_core.losses import LossSpec
    from sfl_core.methods.base import RoundPlan
    from sfl_core.model.accounting import SplitCost
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment
    from sfl_core.wire.protocol import Message

__all__ = ["AssignField", "DeviceContext", "DeviceOption", "Phase", "PhaseAgent", "Recommendation", "RoundContext",
           "RoundOption", "RowsTrained", "ServerTerms", "in_range", "split_state"]


@dataclass(frozen=True)
class AssignField:
    """One field an option adds to an assignment: its wire type(s) and its range check, run by
    the agent before anything uses the value (and by the coordinator's schema on the way out)."""

    types: Any
    """The Python type(s) msgpack decodes it to (the protocol schema's entry)."""
    check: Optional[Callable[[Any], Optional[str]]] = None
    """None if the value is acceptable, else why not (``assign.<field>: <why>``)."""


@dataclass(frozen=True)
class Recommendation:
    """What an option makes of a fleet when the run leaves it to ``strategy: auto``."""

    changes: Optional[Mapping[str, Any]]
    """Its section's fields to set (the option on, so), or None: off."""
    reason: str
    """Why, in one line, from the evidence (the plan and the run log print it)."""


@dataclass
class ServerTerms:
    """What the round's options ask of the server's copies, merged over the options."""

    corrections: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Per agent with a server copy of its own: a term added to that copy's gradients."""
    proximal: float = 0.0
    """A proximal term ``μ (w − x)`` on every copy (0: none)."""
    frozen_norms: bool = False
    """The copies' BatchNorm layers normalise with the model's statistics and keep them (the
    devices' too)."""
    devices_own_norms: bool = False
    """The devices' BatchNorm layers are their own, not the model's (FedBN): the coordinator cannot
    run a client portion as a device runs it (:meth:`RoundContext.reference_rows` is None)."""


@dataclass(frozen=True)
class RowsTrained:
    """Which of an agent's rows a server step trains on, where an option has it train on fewer
    than it sent (:meth:`RoundOption.rows_trained`), and which of them each row sent takes its
    gradient from."""

    kept: torch.Tensor
    """The indices of the rows trained on, in the order sent."""
    source: torch.Tensor
    """For each row sent, the position among :attr:`kept` of the row it takes its gradient from."""

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows trained on, of ``rows`` (activations or labels, as sent)."""
        return rows[self.kept.to(rows.device)]

    def spread(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of each row sent, from ``grad`` (of the rows trained on, the gradient of
        the agent's mean loss over them): its source's, scaled so the agent's gradient stays that
        of its mean loss over the rows it sent."""
        return grad[self.source.to(grad.device)] * (len(self.kept) / len(self.source))

    def then(self, other: "RowsTrained") -> "RowsTrained":
        """This narrowing, then ``other`` on the rows this one keeps."""
        return RowsTrained(self.kept[other.kept], other.source[self.source])


class PhaseAgent(Protocol):
    """An agent's book-keeping in a phase of its own (the engine's ``RoundAgent``)."""

    assignment: "Assignment"
    server_s: float


@dataclass
class Phase:
    """A phase an option ran after aggregation (a statistics pass): the engine prices it by the
    clock as a phase of the round of its own and records it under the option's key."""

    agents: Mapping[str, Any]
    """The agents that answered, with their book-keeping (bytes, response and server times)."""
    wall_s: float
    samples: int
    """Forward passes each agent ran (what the time model charges a third of a step for)."""


class RoundContext(Protocol):
    """What an option's hooks may use of the round engine (the engine implements it)."""

    @property
    def cfg(self) -> "RunConfig": ...

    @property
    def model(self) -> "SplitModel": ...

    @property
    def costs(self) -> Mapping[int, "SplitCost"]: ...

    @property
    def fleet(self) -> Mapping[str, "AgentInfo"]: ...

    @property
    def parameter_names(self) -> set[str]: ...

    def client_state(self, split: int, width: int) -> dict[str, torch.Tensor]: ...

    def server_params(self, split: int, width: int) -> dict[str, torch.Tensor]: ...

    def exchange(self, r: int, step: int, requests: Mapping[str, tuple["Assignment", str, dict[str, Any]]],
                 reply: str) -> tuple[dict[str, "Message"], dict[str, PhaseAgent]]:
        """Send each agent its request (assignment, message type, body) and collect its reply;
        an agent that does not answer is dropped as in any step."""
        ...

    def reject(self, why: str) -> None:
        """Count and log an invalid reply (once per sender and reason a minute)."""
        ...

    def encode_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Tensors as the wire carries them, at the run's compression level."""
        ...

    def log(self, text: str, *, warning: bool = False) -> None:
        """One line in the coordinator's log."""
        ...

    def reference_rows(self, split: int, width: int) -> Optional[torch.Tensor]:
        """The activations the round's client portion at ``split`` (bottleneck ``width``) makes of a
        batch of the server's held-out inputs, run as a device runs it; None: the server holds no
        validation data, or the devices run layers of their own (:class:`ServerTerms`)."""
        ...

    def labelled_reference(self, split: int, width: int,
                           select: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Up to 512 of the server's held-out samples as :meth:`reference_rows` makes them (on the
        CPU), with their labels; ``select``: only those of them (indices), run as one batch; None:
        as :meth:`reference_rows`."""
        ...

    def held_out_labels(self) -> Optional[torch.Tensor]:
        """The labels :meth:`labelled_reference` returns, without running a client portion (a
        reference of each device's own mix reads them to pick its samples); None where it
        returns None."""
        ...

    def quarantine(self, agent_id: str, why: str) -> None:
        """Stop selecting the agent until an operator readmits it (logged, kept in the checkpoint)."""
        ...

    def correct_mix(self, agent_id: str, counts: list[int]) -> None:
        """Replace the mix of classes the agent registered (what the planners read) by ``counts``,
        as many samples in all (kept in the checkpoint; a new registration claims afresh)."""
        ...


class RoundOption:
    """A training option's hooks; the base class does nothing in every one.

    Class attributes:
        SECTION: its run-config section class (``KEY`` is the YAML key).
        ASSIGN_FIELDS: the fields it adds to an assignment, by wire name.
        MESSAGES: message types of its own: ``type -> (direction, {field: type})``, direction
            ``"coordinator"`` (sent to agents, signed) or ``"agent"``.
        RUN_INFO: the keys :meth:`run_info` may add to the run description.
        STATE_PREFIX: its checkpoint tensors' names start with this (``@<name>/``).
    """

    SECTION: ClassVar[type["OptionSection"]]
    ASSIGN_FIELDS: ClassVar[Mapping[str, AssignField]] = {}
    MESSAGES: ClassVar[Mapping[str, tuple[str, Mapping[str, Any]]]] = {}
    RUN_INFO: ClassVar[tuple[str, ...]] = ()
    STATE_PREFIX: ClassVar[str] = ""

    @classmethod
    def settings(cls, cfg: "RunConfig") -> Any:
        """This option's section of ``cfg``."""
        return cfg.sections[cls.SECTION.KEY]

    @classmethod
    def wanted(cls, cfg: "RunConfig") -> bool:
        """Whether ``cfg`` switches the option on (the engine builds only those): by default the
        ``on`` property of its section, where the section has one."""
        return bool(getattr(cls.settings(cfg), "on", False))

    @classmethod
    def left_to_auto(cls, cfg: "RunConfig") -> bool:
        """Whether ``cfg`` leaves this option to ``strategy: auto``: by default, whether its
        section's switch (the field its ``SHORTHAND`` names) says ``auto``. An option whose switch
        has no ``auto`` value is never left to auto; one that has it answers :meth:`recommend`."""
        section = cls.settings(cfg)
        return bool(section.SHORTHAND) and getattr(section, section.SHORTHAND) == "auto"

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """Whether this option pays on a fleet with this ``evidence``, and with what settings;
        ``on``: whether it is on now (the rule may ask more to switch a running option off than
        to switch it on, so that the choice does not flap)."""
        return Recommendation(None, "not decided by auto")

    @classmethod
    def run_info(cls, cfg: "RunConfig") -> dict[str, Any]:
        """What the run description says of it, so that an agent that cannot honour the option
        refuses the run rather than train without it."""
        return {}

    # ------------------------------------------------------------------ time model
    @classmethod
    def portions_down(cls, cfg: "RunConfig") -> int:
        """Client portions it adds to a device's download per round (the time model prices them)."""
        return 0

    @classmethod
    def portions_held(cls, cfg: "RunConfig") -> int:
        """Client portions it adds to what a device holds while it trains (memory)."""
        return 0

    @classmethod
    def phase_cost(cls, cfg: "RunConfig", costs: Mapping[int, "SplitCost"], infos: Mapping[str, "AgentInfo"],
                   plans: Mapping[str, tuple[int, str, int]]) -> tuple[float, float]:
        """Seconds and bytes per round a phase of its own adds, by the time model, for a round of
        ``plans`` (agent -> split, codec, bottleneck width); (0, 0): none."""
        return 0.0, 0.0

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        self.cfg = cfg
        self.section = self.settings(cfg)

    # ------------------------------------------------------------------ a round
    def server_terms(self, ctx: RoundContext, r: int, plan: "RoundPlan", split_agents: Sequence[str],
                     assignments: Mapping[str, "Assignment"], terms: ServerTerms) -> None:
        """Add what the server's copies need this round to ``terms``."""

    def lr_factor(self, r: int) -> float:
        """What round ``r``'s learning rate, of devices and server alike, is multiplied by."""
        return 1.0

    def assign_fields(self, ctx: RoundContext, r: int, agent: str, split: int, width: int) -> dict[str, Any]:
        """The fields of :attr:`ASSIGN_FIELDS` this agent's assignment carries this round."""
        return {}

    def server_loss(self, spec: "LossSpec") -> "LossSpec":
        """The server's loss, as the method asked for it (``spec``) and this option changes it."""
        return spec

    def screen_rows(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                    assignments: Mapping[str, "Assignment"], labels: Mapping[str, torch.Tensor]) -> set[str]:
        """The agents whose ``rows`` (the activations this server step received, decoded and
        validated; ``labels``: the labels that came with them, for the agents that send labels)
        this option leaves out of the step: their rows join no forward and they get a zero
        gradient back. Called before the server's forward, on every server worker."""
        return set()

    def rows_trained(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                     labels: Mapping[str, torch.Tensor]) -> dict[str, RowsTrained]:
        """Per agent whose ``rows`` (those :meth:`screen_rows` let into the step) this option has
        the step train on fewer of (a row sent twice trained once), which (:class:`RowsTrained`);
        each row sent still gets a gradient back. Empty: every row, as sent. Called after
        :meth:`screen_rows`, on every server worker."""
        return {}

    def worker_findings(self, r: int) -> dict[str, Any]:
        """With server workers (``sfl-coord serve --server-workers N``): what this option found in
        round ``r`` on a worker's own rows (:meth:`screen_rows`) that the leader's copy must hear
        of to aggregate (msgpack-able: plain numbers, strings, lists, dicts). Empty: nothing."""
        return {}

    def merge_worker_findings(self, ctx: RoundContext, r: int, findings: Mapping[str, Any]) -> None:
        """On the leader, before the round's aggregation: what a worker's copy of this option
        reported (:meth:`worker_findings`). It comes from the run's own processes, but is checked
        like anything received."""

    def screen(self, ctx: RoundContext, r: int, start: Mapping[str, torch.Tensor],
               clients: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
               assignments: Mapping[str, "Assignment"],
               refused: Mapping[str, str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
        """The round's client states and their weights in the average, as this option lets them
        in (bounded, clipped, or an agent left out: both dicts without it); ``assignments``:
        what each agent was asked to train; ``refused``: the round's agents whose activations,
        logit gradients or weights the coordinator refused as invalid (NaN, out of range), and
        why: they are in neither dict."""
        return clients, weights

    def aggregate(self, ctx: RoundContext, states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                  defaults: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """The round's average of the layer-wise participants' ``states`` if this option computes it
        (a robust rule); None: the weighted mean. The first option that answers decides."""
        return None

    def round_metrics(self) -> dict[str, Any]:
        """What the round's metrics record holds under the option's key (empty: nothing)."""
        return {}

    def observe_updates(self, ctx: RoundContext, start: Mapping[str, torch.Tensor],
                        clients: Mapping[str, Mapping[str, torch.Tensor]],
                        servers: Mapping[str, Mapping[str, torch.Tensor]],
                        assignments: Mapping[str, "Assignment"], terms: ServerTerms,
                        server_steps: Callable[[str], tuple[float, int, float]]) -> None:
        """The round's trained states, before they are averaged (``start``: the model the round
        began from; ``server_steps(a)``: lr, steps and momentum of agent ``a``'s server copy)."""

    def transform_average(self, ctx: RoundContext, start: Mapping[str, torch.Tensor],
                          average: dict[str, torch.Tensor], clients: Mapping[str, Mapping[str, torch.Tensor]],
                          servers: Mapping[str, Mapping[str, torch.Tensor]],
                          copy_of: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """The new global state from the round's ``average`` of the ``clients``' and ``servers``'
        states (``copy_of``: agent -> its server copy)."""
        return average

    def phase(self, ctx: RoundContext, r: int, done: Mapping[str, "Assignment"]) -> Optional[Phase]:
        """A phase after aggregation, with the agents that completed the round; None: none this round."""
        return None

    def after_round(self, ctx: RoundContext, r: int) -> None:
        """The round's model is final (aggregated, its phases run)."""

    def delivered(self, model: "SplitModel") -> Optional[dict[str, torch.Tensor]]:
        """The state the run delivers (evaluates, exports) instead of ``model``'s; None: ``model``'s."""
        return None

    @classmethod
    def delivered_from_checkpoint(cls, model: Mapping[str, torch.Tensor],
                                  own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The delivered weights from a checkpoint's tensors (``own``: its ``@`` tensors)."""
        return dict(model)

    # ------------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Its state, saved with the model (names start with :attr:`STATE_PREFIX`)."""
        return {}

    def load_state(self, tensors: Mapping[str, torch.Tensor], last_round: int, model: "SplitModel") -> None:
        """Continue after ``last_round`` from a checkpoint's ``@`` tensors (a checkpoint from
        before the option was switched on has none: it starts afresh)."""

    # ------------------------------------------------------------------ the device
    @classmethod
    def device(cls) -> Optional["DeviceOption"]:
        """Its part on the device (one per agent process, kept across rounds); None: nothing."""
        return None


class DeviceContext(Protocol):
    """What an option's handler may use of the agent (``edge_agent.agent.AgentCore``)."""

    run_id: str
    agent_id: str
    data: Any
    """The device's private shard (``x``, ``y``, ``num_classes``)."""
    input_shape: tuple[int, ...]
    privacy: Any
    noise_generator: torch.Generator

    def standardise(self, constants: Optional[dict]) -> None: ...

    def model(self, name: str, split: int, width: int) -> "SplitModel": ...

    def batch(self, stream: int, batch_size: int) -> torch.Tensor:
        """The next batch's indices from the reshuffled epochs of sampler stream ``stream`` (a seed offset)."""
        ...

    def compute_seconds(self, flops: float, seconds: float) -> float:
        """The seconds to report for ``flops`` done in ``seconds`` (an emulated device's)."""
        ...

    def resend(self) -> list["Message"]: ...

    def remember(self, replies: list["Message"]) -> list["Message"]: ...


class DeviceOption:
    """A training option on the device, told of each assignment's fields (validated) and of
    the end of its local training."""

    def on_assign(self, fields: Mapping[str, Any], model: "SplitModel", split: int, client: torch.nn.Module,
                  weights: Mapping[str, torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The assignment's ``weights`` are loaded into ``model``: adjust the client portion,
        and return the terms to add to its parameters' gradients at every local step."""
        return []

    def proximal(self, fields: Mapping[str, Any]) -> float:
        """A proximal term's μ for every local step (0: none)."""
        return 0.0

    def on_trained(self, model: "SplitModel", state: Mapping[str, torch.Tensor]) -> None:
        """The round's local training is over; ``state`` is what is about to be uploaded."""

    def handles(self) -> Mapping[str, Callable[..., Any]]:
        """Message types it answers on the device (type -> handler of (agent, message))."""
        return {}


def split_state(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as (the model's, the options' own state: every name starting
    with ``@``, which no module name can)."""
    model = {k: t for k, t in tensors.items() if not k.startswith("@")}
    return model, {k: t for k, t in tensors.items() if k.startswith("@")}
