"""What the round engine offers the training options' hooks (:class:`sfl_core.options.base.RoundContext`):
the fleet, the model's portions as an agent and a server copy hold them, the wire, and a phase
of requests and replies run like any step (an agent that does not answer is dropped)."""

from __future__ import annotations

import copy
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, cast

import torch
from coordinator.session import RoundAgent
from coordinator.validation import screen_draw
from sfl_core.model.bottleneck import slice_state
from sfl_core.model.norm_layers import batch_norm_layers, runs_alike_in_either_mode
from sfl_core.option_registry import build_options
from sfl_core.options.base import PhaseAgent, RoundContext, RoundOption, RowsTrained, ServerTerms
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import Assignment
from sfl_core.wire.protocol import Message

if TYPE_CHECKING:
    from pathlib import Path

    from coordinator.registry import Registry
    from coordinator.server_trainer import ServerTrainer
    from coordinator.server_workers import ServerShards
    from sfl_core.losses import LossSpec
    from sfl_core.methods.base import Method
    from coordinator.session import FleetSession
    from sfl_core.config.run import RunConfig
    from sfl_core.data.preprocessing import Normalization
    from sfl_core.model.zoo import SplitModel
    from coordinator.validation import ValidationSet

log = logging.getLogger("sfl.coord")

REFERENCE_ROWS = 64
"""Held-out inputs the coordinator runs a client portion on for :meth:`OptionHost.reference_rows`."""

LABELLED_REFERENCE_ROWS = 512
"""Held-out samples behind :meth:`OptionHost.labelled_reference` (about 50 a class of ten)."""

PASS_ROWS = 64
"""Held-out inputs the client portion runs on at a time where no layer normalises by its batch:
the same rows come out as in one pass, and a pass's activations stay in the CPU's caches (a
first convolution's output over 512 images does not)."""


class OptionHost:
    """The engine's side of the option seam (a part of :class:`coordinator.engine.RoundEngine`)."""

    cfg: "RunConfig"
    model: "SplitModel"
    registry: "Registry"
    session: "FleetSession"
    options: list[RoundOption]
    method: "Method"
    server: "ServerTrainer"
    history: list[dict[str, Any]]
    out_dir: "Path"
    shards: Optional["ServerShards"]
    on_event: Callable[[str, dict[str, Any]], None]
    _now: Callable[[], float]
    _terms: "ServerTerms"

    validation: "ValidationSet"
    _drawn_rows: Optional[tuple[tuple[Any, ...], torch.Tensor]] = None
    """The client portion's rows of the screens' draw of held-out inputs, and what they were made
    of (split, frozen BatchNorm, the portion's tensors' versions): :meth:`_client_rows`."""

    if TYPE_CHECKING:   # the engine's (coordinator.task_normalization)
        @property
        def normalization(self) -> Optional["Normalization"]: ...

    def settle_options(self, r: int, *, decide: bool = True) -> None:
        """The training options round ``r`` trains with, as the method decides those the config
        leaves to it (``strategy: auto``; :meth:`~sfl_core.methods.base.Method.learning`), each
        change a line in the log; ``decide`` False: the decisions a resumed run had taken. An
        option whose settings stay keeps its state; one switched on starts afresh."""
        accuracy = [h["accuracy"] for h in self.history if h.get("accuracy") is not None]
        cfg, lines = self.method.learning(r, self.registry.agents if decide else None, accuracy,
                                          shared_server=self.shards is not None)
        for line in lines:
            log.info("%s", line)
            self.on_event("notice", {"text": line})
        if cfg == self.cfg:
            return
        self.cfg = cfg
        self.method.use_config(cfg)
        self.options = build_options(cfg, self.model, keep=self.options)
        self.server.loss = self.server_loss()

    def screen_rows(self, r: int, step: int, agents: Mapping[str, RoundAgent],
                    batches: Mapping[str, tuple[torch.Tensor, Optional[torch.Tensor]]]) -> set[str]:
        """The agents whose rows the step leaves out, as the options screen them
        (:meth:`~sfl_core.options.base.RoundOption.screen_rows`)."""
        ctx = cast("RoundContext", self)
        out: set[str] = set()
        for option in self.options:
            kept = [a for a in batches if a not in out]
            out |= option.screen_rows(ctx, r, step, {a: batches[a][0] for a in kept},
                                      {a: agents[a].assignment for a in batches},
                                      {a: y for a in kept if (y := batches[a][1]) is not None})
        return out

    def rows_trained(self, r: int, step: int, batches: Mapping[str, tuple[torch.Tensor, Optional[torch.Tensor]]]
                     ) -> dict[str, RowsTrained]:
        """Per agent of ``batches`` (the rows let into the step) whose rows the options have the
        step train on fewer of, which (:meth:`~sfl_core.options.base.RoundOption.rows_trained`;
        each option narrows what the ones before it kept). Only agents that sent their labels:
        the logits of an agent that keeps them go back to it row for row."""
        ctx = cast("RoundContext", self)
        out: dict[str, RowsTrained] = {}
        labelled = {a: (x, y) for a, (x, y) in batches.items() if y is not None}
        for option in self.options:
            now = {a: (out[a].take(x), out[a].take(y)) if a in out else (x, y) for a, (x, y) in labelled.items()}
            for a, rows in option.rows_trained(ctx, r, step, {a: x for a, (x, _) in now.items()},
                                               {a: y for a, (_, y) in now.items()}).items():
                out[a] = out[a].then(rows) if a in out else rows
        return out

    def worker_findings(self, r: int) -> dict[str, Any]:
        """A server worker's options' findings on its rows this round, by option key."""
        return {o.SECTION.KEY: found for o in self.options if (found := o.worker_findings(r))}

    def merge_worker_findings(self, r: int, reports: Sequence[Mapping[str, Any]]) -> None:
        """The leader's options hear what the workers' copies found (:meth:`worker_findings`)."""
        ctx = cast("RoundContext", self)
        for found in reports:
            for option in self.options:
                mine = found.get(option.SECTION.KEY) if isinstance(found, Mapping) else None
                if isinstance(mine, Mapping):
                    option.merge_worker_findings(ctx, r, mine)

    def server_loss(self) -> "LossSpec":
        """How the server scores its rows: the method's loss, as the run's options change it."""
        return functools.reduce(lambda spec, o: o.server_loss(spec), self.options, self.method.server_loss())

    def option(self, kind: type) -> Any:
        """The run's option of class ``kind`` (None if the config leaves it off)."""
        return next((o for o in self.options if isinstance(o, kind)), None)

    @property
    def fleet(self) -> dict[str, Any]:
        """Every registered agent's info."""
        return self.registry.agents

    @property
    def parameter_names(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()}

    def encode_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return wire.encode_state(state, self.cfg.zstd_level)

    def reject(self, why: str) -> None:
        self.session.rejections.reject("invalid", why)

    def log(self, text: str, *, warning: bool = False) -> None:
        (log.warning if warning else log.info)(text)

    def quarantine(self, agent_id: str, why: str) -> None:
        info = self.registry.agents.get(agent_id)
        if info is None or info.quarantined:
            return
        info.quarantined = why
        self._notice(f"quarantined {agent_id}: {why}; it is no longer selected until an operator readmits it "
                     f"(sfl-coord agents readmit {self.out_dir} {agent_id})")

    def correct_mix(self, agent_id: str, counts: list[int]) -> None:
        info = self.registry.agents.get(agent_id)
        if info is not None and sum(counts) == info.num_samples and len(counts) == len(info.label_counts):
            info.label_counts = list(counts)

    def _notice(self, line: str) -> None:
        """One line for the operator: the log (a warning) and the run's display."""
        log.warning("%s", line)
        self.on_event("notice", {"text": line})

    def exchange(self, r: int, step: int, requests: Mapping[str, tuple[Assignment, str, dict[str, Any]]],
                 reply: str) -> tuple[dict[str, Message], dict[str, PhaseAgent]]:
        now = self._now()
        asked = {a: RoundAgent(a, assignment, last_heard=now, last_sent_at=now)
                 for a, (assignment, _type, _body) in requests.items()}
        for a, (_assignment, mtype, body) in requests.items():
            if self.cfg.task is not None and self.normalization is not None:
                body["normalize"] = self.normalization.to_wire()
            self.session.send(asked[a], Message(mtype, self.cfg.run_id, protocol.COORDINATOR_ID, body, round=r,
                                                step=step, seq=protocol.next_seq()))
        return self.session.collect(asked, reply, r, step, only=list(asked)), dict(asked)

    def server_params(self, split: int, width: int) -> dict[str, torch.Tensor]:
        """The parameters a server copy trains for an agent of this split and bottleneck width."""
        state = self.model.server_state(split)
        state = {**state, **slice_state(state, f"bottlenecks.{split}.", width)} if width else state
        return {k: v for k, v in state.items() if k in self.parameter_names}

    def reference_rows(self, split: int, width: int) -> Optional[torch.Tensor]:
        return self._client_rows(split, width, self._screened()[:REFERENCE_ROWS])

    def labelled_reference(self, split: int, width: int,
                           select: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``select``: indices into the labels this returns without it (a device's mix of classes).
        Where the portion normalises by no batch, a selection's rows are those of the whole
        draw, which is run once while the model stands (:meth:`_client_rows`)."""
        drawn = self._screened()
        if select is not None and not self._by_batch(split):
            rows = self._client_rows(split, width, drawn)
            return None if rows is None else (rows[select].cpu(), self.validation.y[drawn[select]].cpu())
        index = drawn if select is None else drawn[select]
        rows = self._client_rows(split, width, index)
        return None if rows is None else (rows.cpu(), self.validation.y[index].cpu())

    def held_out_labels(self) -> Optional[torch.Tensor]:
        if self._terms.devices_own_norms or not len(self.validation):
            return None
        return self.validation.y[self._screened()].cpu()

    def _screened(self) -> torch.Tensor:
        """The held-out samples the screens read (:func:`~coordinator.validation.screen_draw`),
        drawn once (a permutation of a large set costs milliseconds, and the matched screen
        reads it per device and round)."""
        total = len(self.validation)
        drawn = getattr(self, "_screen_drawn", None)
        if drawn is None or drawn[0] != total:
            drawn = self._screen_drawn = (total, screen_draw(total, LABELLED_REFERENCE_ROWS))
        return drawn[1]

    def _client_rows(self, split: int, width: int, index: torch.Tensor) -> Optional[torch.Tensor]:
        """The round's client portion at ``split`` (``width``) on the held-out inputs at ``index``,
        as a device runs it; None where there are none, or where no device runs it so (its
        BatchNorm layers are its own).

        A portion that normalises by no batch runs :data:`PASS_ROWS` inputs at a time, so a pass
        over a prefix of the screens' draw is the first passes over the whole draw: the rows of
        the draw made so far are kept while the model stands as it is (each round the sizes
        screen reads the first :data:`REFERENCE_ROWS` of them, the label screen all of them), and
        only what is not kept yet is run."""
        if not len(self.validation.y[index]) or self._terms.devices_own_norms:
            return None
        frozen = self._terms.frozen_norms   # the devices normalise with the model's statistics
        portion = self.model.client(split)
        by_batch = self._by_batch(split)
        drawn = self._screened()
        if by_batch or len(index) > len(drawn) or not torch.equal(index, drawn[:len(index)]):
            return _narrowed(self._run_portion(split, index, by_batch), width)
        key = (split, frozen, _versions(portion))
        cached = self._drawn_rows
        kept = cached[1] if cached is not None and cached[0] == key else None
        if kept is None or len(kept) < len(index):
            whole = 0 if kept is None else len(kept) - len(kept) % PASS_ROWS   # a last part-pass is run again
            more = self._run_portion(split, index[whole:], by_batch)
            kept = more if kept is None else torch.cat([kept[:whole], more])
            self._drawn_rows = (key, kept)
        return _narrowed(kept[:len(index)], width)

    def _by_batch(self, split: int) -> bool:
        """Whether the client portion at ``split`` normalises by its batch as a device runs it
        (BatchNorm in training mode, or without running statistics)."""
        frozen = self._terms.frozen_norms
        return any(not frozen or layer.running_mean is None
                   for layer in batch_norm_layers(self.model.client(split)).values())

    def cut_to_keep(self) -> Optional[int]:
        """The split whose held-out rows the screens read last, where scoring the model can make
        the next round's on the way (:meth:`keep_drawn_rows`): its client portion runs alike in
        either mode (an evaluation runs it in inference mode, a device trains it), and no
        bottleneck splits the model there (the whole model would run the pair whole); None
        otherwise, or before any screen read rows."""
        cached = self._drawn_rows
        if cached is None:
            return None
        split, frozen, _ = cached[0]
        if self.model.bottleneck(split) is not None or not runs_alike_in_either_mode(self.model.client(split), frozen):
            return None
        return split

    def keep_drawn_rows(self, split: int, rows: torch.Tensor) -> None:
        """``rows``: the client portion at ``split`` (:meth:`cut_to_keep`) on the whole draw of
        held-out inputs the screens read, as the model stands."""
        assert self._drawn_rows is not None, "cut_to_keep names a split only once the screens read one"
        self._drawn_rows = ((split, self._drawn_rows[0][1], _versions(self.model.client(split))), rows)

    def _run_portion(self, split: int, index: torch.Tensor, by_batch: bool) -> torch.Tensor:
        """The client portion at ``split``, in a device's mode, on the held-out inputs at ``index``:
        as one batch where it normalises by its batch, else :data:`PASS_ROWS` at a time."""
        client = copy.deepcopy(self.model.client(split)).train()   # a device's mode; the model's statistics untouched
        if self._terms.frozen_norms:
            for layer in batch_norm_layers(client).values():
                layer.eval()
        device = next(self.model.parameters()).device
        # a user's model may hold dropout: the run's random streams must not move for this pass
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return self.validation.forward(client, device, index, len(self.validation.y) if by_batch else PASS_ROWS)

    def client_state(self, split: int, width: int) -> dict[str, torch.Tensor]:
        """What an agent of this split and bottleneck width holds (encoder rows ``[:width]``)."""
        state = self.model.client_state(split)
        return {**state, **slice_state(state, f"bottlenecks.{split}.", width)} if width else state


def _narrowed(rows: torch.Tensor, width: int) -> torch.Tensor:
    """A bottleneck's encoder output as an agent of ``width`` sends it (its first channels; all: 0)."""
    return rows[:, :width] if width else rows


def _versions(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each of ``module``'s tensors lies and how often it was written: changed by any update
    of its parameters or statistics (an in-place write, a state loaded, a tensor replaced)."""
    return tuple((t.data_ptr(), t._version) for t in (*module.parameters(), *module.buffers()))
