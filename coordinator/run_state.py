"""The engine's run state on disk: what a checkpoint saves beside the model after each round,
round 0's record, and a resume that checks everything before anything on disk changes."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from coordinator import state as ckpt
from coordinator.export import describe_model, restore_widths
from sfl_core.data.preprocessing import Normalization
from sfl_core.options.base import split_state

if TYPE_CHECKING:
    from coordinator.clock import Clock
    from coordinator.registry import Registry
    from sfl_core.config.run import RunConfig
    from sfl_core.methods.base import Method
    from sfl_core.model.zoo import SplitModel
    from sfl_core.options.base import RoundOption

log = logging.getLogger("sfl.coord")


class RunState:
    """Checkpoint, round 0 and resume (a part of :class:`coordinator.engine.RoundEngine`)."""

    cfg: "RunConfig"
    model: "SplitModel"
    method: "Method"
    registry: "Registry"
    clock: "Clock"
    options: "list[RoundOption]"
    out_dir: Path
    history: list[dict[str, Any]]
    start_round: int
    preprocessing: Optional[dict[str, Any]]
    _latest_width: dict[str, int]
    device: torch.device

    if TYPE_CHECKING:   # the engine's other parts (coordinator.task_normalization, coordinator.scoring)
        @property
        def normalization(self) -> Optional[Normalization]: ...

        def _standardise(self, norm: Normalization) -> None: ...

        def evaluate(self) -> tuple[Optional[float], Optional[float]]: ...

        def settle_options(self, r: int, *, decide: bool = True) -> None: ...

    def _checkpoint_state(self, r: int) -> dict[str, Any]:
        """The run state saved with the model after round ``r`` (what ``--resume`` reads), all but
        the registry, which the checkpoint adds as the text it keeps encoded."""
        return {
            "round": r, "rounds": self.cfg.rounds, "elapsed_s": self.clock.elapsed, "model": self.cfg.model,
            "run": self.cfg.run_id,
            "strategy": self.cfg.strategy,
            **self.method.to_json(),
            **({"latest_widths": dict(self._latest_width)} if self._latest_width else {}),
            "model_info": describe_model(self.model, self._dataset_name(), self.preprocessing),  # lets `sfl-coord export` rebuild it
            **({"normalize": self.normalization.to_wire()} if self.cfg.task is not None and self.normalization else {})}

    def _dataset_name(self) -> str:
        return "local" if self.cfg.task is not None else self.cfg.data.dataset

    def _record_initial(self) -> None:
        """Round 0: the untrained model's accuracy, so curves start at time zero."""
        eval0 = time.monotonic()
        accuracy, test_loss = self.evaluate()
        eval_s = time.monotonic() - eval0
        record: dict[str, Any] = {"round": 0, "accuracy": accuracy, "test_loss": test_loss, "train_loss": None,
                  "round_time_s": 0.0, "elapsed_s": 0.0, "clock": "virtual" if self.clock.virtual else "wall",
                  "wall_s": round(eval_s, 4), "eval_s": round(eval_s, 4), "waiting_s": 0.0, "bytes_up": 0, "bytes_down": 0, "selected": [],
                  "completed": [], "groups": [], "phase": "initial", "agents": {}}
        self.history.append(record)
        ckpt.append_metrics(self.out_dir, record)

    def _resume(self, model_state: dict[str, torch.Tensor], st: dict[str, Any]) -> None:
        """Continue after the checkpoint's round. Everything is checked before anything on disk
        changes: a checkpoint that does not fit this run is a CheckpointError naming the file."""
        path = self.out_dir / ckpt.MODEL_FILE
        ckpt.check_fits(path, st, model=self.cfg.model, run_id=self.cfg.run_id, rounds=self.cfg.rounds)
        model_state, own_state = split_state(model_state)
        ckpt.check_tensors(path, model_state, self.model.state_dict(), model=self.cfg.model)
        try:
            self.model.load_state_dict({k: v.to(self.device) for k, v in model_state.items()})
            self.registry.load_totals(st.get("registry", {}))
            self.method.load_json(st)
            self.settle_options(st["round"] + 1, decide=False)   # the options as the run had them
            restore_widths(self.model, st.get("model_info") or {})   # the widths trained so far
            for option in self.options:   # a checkpoint from before one was switched on: it starts afresh
                option.load_state(own_state, st["round"], self.model)
            self._latest_width = {str(k): int(v) for k, v in (st.get("latest_widths") or {}).items()}
            if self.cfg.task is not None and st.get("normalize") is not None:
                self._standardise(Normalization.from_wire(st["normalize"], self.cfg.task.input_shape[0],
                                                          "checkpoint normalize"))
            elapsed = float(st.get("elapsed_s", 0.0))
        except (RuntimeError, TypeError, KeyError, ValueError, AttributeError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ckpt.CheckpointError(f"{path}: does not fit this run's model {self.cfg.model!r} ({first})") from None
        history = ckpt.read_metrics(self.out_dir)   # a corrupted metrics file stops us here, untouched
        self.clock.restore(elapsed)
        self.start_round = st["round"] + 1
        ckpt.truncate_metrics(self.out_dir, st["round"])
        self.history = [m for m in history if m["round"] <= st["round"]]
        log.info("resuming %s after round %d", self.cfg.run_id, st["round"])
