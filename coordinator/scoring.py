"""How the engine scores the model the run delivers: on the server's validation set, and on the
devices' held-out splits (federated evaluation, :mod:`coordinator.evaluation`)."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from coordinator import evaluation, shard_scoring
from coordinator.server_workers import workers_hold_validation
from coordinator.session import RoundAgent
from sfl_core.model.zoo import SplitModel
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message

if TYPE_CHECKING:
    from coordinator.server_workers import ServerShards
    from coordinator.session import FleetSession
    from coordinator.validation import ValidationSet
    from sfl_core.config.run import RunConfig
    from sfl_core.data.preprocessing import Normalization
    from sfl_core.options.base import RoundOption

log = logging.getLogger("sfl.coord")


class Scoring:
    """Evaluation (a part of :class:`coordinator.engine.RoundEngine`)."""

    cfg: "RunConfig"
    model: SplitModel
    options: "list[RoundOption]"
    session: "FleetSession"
    shards: Optional["ServerShards"]
    validation: "ValidationSet"
    device: torch.device
    _eval_batch: int

    if TYPE_CHECKING:   # the engine's (coordinator.task_normalization, coordinator.option_host)
        @property
        def normalization(self) -> Optional["Normalization"]: ...

        def cut_to_keep(self) -> Optional[int]: ...

        def keep_drawn_rows(self, split: int, rows: torch.Tensor) -> None: ...

        def _screened(self) -> torch.Tensor: ...

    def _federated_evaluation(self, r: int, agents: dict[str, RoundAgent], done: list[str]) -> Optional[dict[str, Any]]:
        """Every ``eval.federated_every`` rounds the round's completed agents score the new global
        model on their held-out splits (:mod:`coordinator.evaluation`; None in other rounds). An
        agent that does not answer is dropped as in any step."""
        every = self.cfg.eval.federated_every
        if not every or r % every or not done:
            return None
        body = evaluation.request_body(self.delivered_model(), self.cfg.model, self.cfg.zstd_level,
                                       self.normalization if self.cfg.task is not None else None)
        step = self.cfg.local_iters   # after the round's last training step
        asked = [a for a in done if a in agents]
        for a in asked:
            self.session.send(agents[a], Message("evaluate", self.cfg.run_id, protocol.COORDINATOR_ID, body,
                                                 round=r, step=step, seq=protocol.next_seq()))
        replies = self.session.collect(agents, "evaluation", r, step, only=asked)
        return evaluation.summarise(replies, lambda why: self.session.rejections.reject("invalid", why))

    def _evaluates(self, r: int) -> bool:
        """Round ``r`` is scored on the server's validation set: every ``eval_every`` rounds and the last."""
        return r % self.cfg.eval_every == 0 or r >= self.cfg.rounds

    def evaluate(self) -> tuple[Optional[float], Optional[float]]:
        """Accuracy and mean loss of the model the run delivers on the server's validation set
        (None, None without one: a task run whose server holds no validation data). Where that
        is the model the next round trains, and the screens read held-out rows at one of its
        cuts, the score makes them on the way (:meth:`OptionHost.cut_to_keep`): the round's client
        portion is run over the held-out set once, not twice. With several server workers that
        hold the set, each scores a block of it (:mod:`coordinator.shard_scoring`)."""
        delivered = self.delivered_model()
        split = self.cut_to_keep() if delivered is self.model and len(self.validation) else None
        if self._scoring_shared():
            assert self.shards is not None
            accuracy, loss, rows = shard_scoring.lead(self.shards, self.validation, delivered, split,
                                                      None if split is None else self._screened(), self.device,
                                                      self._eval_batch)
            if split is not None and rows is not None:
                self.keep_drawn_rows(split, rows)
            return accuracy, loss
        if split is None:
            return self.validation.evaluate(delivered, self.device, self._eval_batch)
        accuracy, loss, rows = self.validation.evaluate_at_cut(delivered, split, self._screened(), self.device,
                                                                self._eval_batch)
        self.keep_drawn_rows(split, rows)
        return accuracy, loss

    def score_block(self, doc: dict[str, Any]) -> None:
        """A server worker's block of the leader's score (:meth:`evaluate`; ``doc``: the leader's)."""
        assert self.shards is not None
        part = shard_scoring.follow(self.shards, self.validation, self.model, doc, self.device, self._eval_batch)
        log.info("server worker %d: scored samples %d to %d of the validation set", self.shards.rank,
                 part.start, part.stop - 1)

    def _scoring_shared(self) -> bool:
        """Whether server workers share the score: there are several, and they hold the set."""
        return (self.shards is not None and self.shards.world > 1 and len(self.validation) > 0
                and workers_hold_validation(self.cfg))

    def delivered_model(self) -> SplitModel:
        """The model the run delivers (evaluated, exported): the global model, or with
        the state a training option delivers instead (``model_ema``'s average over rounds) on a copy of it."""
        for option in self.options:
            state = option.delivered(self.model)
            if state is not None:
                delivered = copy.deepcopy(self.model)   # the same bottleneck widths; training keeps the original
                delivered.load_state_dict(state)
                return delivered
        return self.model
