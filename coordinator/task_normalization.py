"""A task run's input standardisation on the coordinator: the constants given, none, or the
fleet's (``normalize: federated``: the registered agents' channel statistics, combined once
before round 1 and published in the run description)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from sfl_core.data.preprocessing import ChannelStats, Normalization, preprocessing_record

if TYPE_CHECKING:
    from coordinator.registry import Registry
    from coordinator.transport import Transport
    from coordinator.validation import ValidationSet
    from sfl_core.config.run import RunConfig
    from coordinator.session import Event

log = logging.getLogger("sfl.coord")


class NoStatistics(RuntimeError):
    """``normalize: federated``, but no registered agent sent its channel statistics."""


class TaskNormalization:
    """The engine's standardisation (a part of :class:`coordinator.engine.RoundEngine`)."""

    cfg: "RunConfig"
    validation: "ValidationSet"
    registry: "Registry"
    transport: "Transport"
    on_event: "Event"
    preprocessing: Optional[dict[str, Any]]

    @property
    def normalization(self) -> Optional[Normalization]:
        """A task run's standardisation constants (None until known); a built-in data set comes standardised."""
        return self.validation.normalization

    def known_normalization(self) -> Optional[dict[str, list[float]]]:
        """The constants as the run description carries them, if known before the fleet registers."""
        return self.normalization.to_wire() if self.normalization is not None and self.cfg.task is not None else None

    def _standardise(self, norm: Normalization) -> None:
        """Adopt the run's constants: the validation set is standardised with them and the model
        records them (what ``sfl-agent predict --raw`` applies)."""
        task = self.cfg.task
        assert task is not None
        self.validation.standardise(norm)
        self.preprocessing = preprocessing_record(task.scale, norm, task.resize,
                                                  None if task.resize else task.input_shape, task.classes)

    def _federated_normalization(self) -> None:
        """``normalize: federated``: combine the registered agents' channel statistics, once,
        before round 1, and publish them in the run description (a late joiner, and a resumed
        run, use the same constants; every assignment carries them as well)."""
        parts = {a: s for a, s in self.registry.channel_stats.items()
                 if a in self.registry.agents and self.registry.agents[a].registered}
        if not parts:
            raise NoStatistics("normalize: federated, but no registered agent sent its channel statistics")
        norm = ChannelStats.combine(parts.values())
        self._standardise(norm)
        self.transport.amend_run_info(normalize=norm.to_wire())   # a deployment: the run description says it too
        text = (f"standardisation from {len(parts)} agent(s), {sum(p.count for p in parts.values())} values per "
                f"channel: mean {[round(m, 4) for m in norm.mean]}, std {[round(v, 4) for v in norm.std]}")
        log.info(text)
        self.on_event("notice", {"text": text})

