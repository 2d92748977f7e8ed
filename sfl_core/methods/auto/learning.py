"""``strategy: auto``'s decisions on the training options a run leaves to it.

Problem: a user who writes no learning switch should get the options that pay on their fleet
(drift correction, federated BatchNorm statistics, server momentum, the delivered average) and
none that only cost time where they do not. Which pay depends on the fleet (how unlike the
devices' label mixes are, whether a round samples the fleet, whether the model normalises
with batch statistics) and on how the run is learning (whether its accuracy swings).

Algorithm: every option the run leaves to auto (its section says ``auto``) is asked for its
own rule, :meth:`~sfl_core.options.base.RoundOption.recommend`, with the evidence
(:class:`~sfl_core.evidence.Evidence`) and whether it is on now. The rules live with their
options, so this module names none; a rule may ask more to switch a running option off than
to switch it on (hysteresis). A decision is kept until the option's rule changes its mind; a
user's explicit setting is never asked about. Each change is one line for the run log and
``sfl-coord plan``, and every round's metrics record the decisions in force.

Cost: one rule call per option and round, on numbers already at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sfl_core import option_registry
from sfl_core.config.run import RunConfig
from sfl_core.evidence import Evidence

__all__ = ["Decision", "LearningOptions"]


@dataclass(frozen=True)
class Decision:
    key: str
    """The option's section key (``drift``)."""
    changes: Optional[dict[str, Any]]
    """Its section's fields set by the decision; None: off."""
    reason: str
    round: int
    """The round the decision was taken before."""

    def line(self) -> str:
        what = ", ".join(f"{k} {v}" for k, v in self.changes.items()) if self.changes is not None else "off"
        return f"auto: {self.key}: {what} (round {self.round}: {self.reason})"

    def to_json(self) -> dict[str, Any]:
        return {"changes": self.changes, "reason": self.reason, "round": self.round}

    @classmethod
    def from_json(cls, key: str, v: Mapping[str, Any]) -> "Decision":
        return cls(str(key), dict(v["changes"]) if v.get("changes") is not None else None,
                   str(v.get("reason", "")), int(v.get("round", 0)))


class LearningOptions:
    """The decisions so far on the options ``cfg`` (the run config as written) leaves to auto."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.decisions: dict[str, Decision] = {}

    def decide(self, r: int, evidence: Evidence) -> list[Decision]:
        """Ask every option left to auto; return the decisions that changed."""
        changed = []
        for option in option_registry.left_to_auto(self.cfg):
            key = option.SECTION.KEY
            now = self.decisions.get(key)
            rec = option.recommend(self.cfg, evidence, now is not None and now.changes is not None)
            changes, reason = (dict(rec.changes) if rec.changes is not None else None), rec.reason
            if changes is not None:
                try:    # a rule that overlooked one of the run's constraints must not stop the run
                    self.cfg.sections[key].replace_in(self.config(), **changes)
                except ValueError as exc:
                    changes, reason = None, f"the run config refuses it ({str(exc).splitlines()[0]})"
            if now is None or now.changes != changes:
                self.decisions[key] = Decision(key, changes, reason, r)
                changed.append(self.decisions[key])
        return changed

    def config(self) -> RunConfig:
        """The run config with the decisions in force."""
        cfg = self.cfg
        for key, d in self.decisions.items():
            if d.changes is not None:
                cfg = cfg.sections[key].replace_in(cfg, **d.changes)
        return cfg

    def summary(self) -> dict[str, Any]:
        """What each decided option is (for the round's metrics): its fields, or ``"off"``."""
        return {key: dict(d.changes) if d.changes is not None else "off" for key, d in self.decisions.items()}

    def to_json(self) -> dict[str, Any]:
        return {key: d.to_json() for key, d in self.decisions.items()}

    def load_json(self, doc: Mapping[str, Any]) -> None:
        """Decisions from a checkpoint (those of options this run no longer leaves to auto are dropped)."""
        keys = {o.SECTION.KEY for o in option_registry.left_to_auto(self.cfg)}
        self.decisions = {str(k): Decision.from_json(k, v) for k, v in (doc or {}).items()
                          if k in keys and isinstance(v, Mapping)}
