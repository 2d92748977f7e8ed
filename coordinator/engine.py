"""The round engine: one implementation for deployments and simulations.

It talks to agents only through a :class:`Transport` (MQTT or in-process) and measures time
only through a clock (wall or virtual). One round: the method (:mod:`sfl_core.methods`)
selects and plans, the engine assigns, runs the merged server steps, aggregates, evaluates
and records (metrics and checkpoints in :mod:`coordinator.state`). Registration, liveness,
replays and resends are the fleet session's (:mod:`coordinator.session`).
"""

from __future__ import annotations

import functools
import math
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from coordinator import shard_round
from coordinator import state as ckpt
from coordinator.clock import Clock
from coordinator.deadline import round_deadline
from coordinator.option_host import OptionHost
from coordinator.pricing import price_phase, price_round
from coordinator.registry import Registry
from coordinator.readmission import apply_readmissions
from coordinator.round_average import RoundAverage, RoundVoid
from coordinator.round_record import round_record
from coordinator.run_parts import RunParts, build_parts
from coordinator.run_state import RunState
from coordinator.scoring import Scoring
from coordinator.server_trainer import ServerTrainer
from coordinator.server_workers import GradReducer, ServerShards
from coordinator.session import DeadlinePassed, Event, FleetSession, RoundAgent
from coordinator.task_normalization import NoStatistics, TaskNormalization
from coordinator.transport import Transport
from coordinator.uploads import decode_activations, decode_logit_gradients
from coordinator.validation import ValidationSet, evaluation_batch
from coordinator.widths import widen_bottlenecks
from sfl_core.config.run import RunConfig
from sfl_core.data.preprocessing import Normalization
from sfl_core.methods.base import RoundPlan
from sfl_core.model.accounting import split_note
from sfl_core.model.bottleneck import bottleneck_shape
from sfl_core.model.fingerprint import digest
from sfl_core.model.zoo import SplitModel
from sfl_core.option_registry import build_options
from sfl_core.timing import window_for
from sfl_core.options.base import ServerTerms
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import SPLIT_TRAINING, WHOLE_MODEL, Assignment
from sfl_core.wire.protocol import Message

log = logging.getLogger("sfl.coord")

ROUND_ATTEMPTS = 5
"""A round that trained too few agents is planned again this many times at most."""


class RoundFailed(RuntimeError):
    """A round could not be trained after ``ROUND_ATTEMPTS`` plans; earlier rounds are
    checkpointed (a restart with ``--resume`` continues)."""


class RoundEngine(OptionHost, TaskNormalization, RunState, Scoring, RoundAverage):
    def __init__(self, cfg: RunConfig, transport: Transport, clock: Clock, test_set: tuple[torch.Tensor, torch.Tensor],
                 *, input_shape: tuple[int, ...], num_classes: int, out_dir: Path,
                 device: torch.device | str = "cpu", on_event: Optional[Event] = None,
                 checkpoint: Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]] = None,
                 preprocessing: Optional[dict[str, Any]] = None, shards: Optional[ServerShards] = None,
                 parts: Optional[RunParts] = None):
        """``checkpoint``: what :func:`coordinator.state.load` read from ``out_dir``, to resume
        after its round (load it before starting anything, so a bad file stops nothing).
        ``preprocessing``: the data set's (``Dataset.preprocessing``), kept with the model.
        ``shards``: this process is one of several server workers (:mod:`coordinator.server_workers`);
        the leader runs :meth:`run`, the others :meth:`serve_shard`. ``parts``: the model and method
        the caller built while checking the config (:func:`coordinator.run_parts.build_parts`)."""
        self.shards = shards
        self.preprocessing = preprocessing
        self.cfg = cfg
        self.transport = transport
        self.clock = clock
        self.validation = ValidationSet(*test_set, limit=cfg.eval_samples)
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.out_dir = Path(out_dir)
        self.device = torch.device(device)
        self.on_event = on_event or (lambda _e, _d: None)
        self._now: Callable[[], float] = transport.live_time
        parts = parts or build_parts(cfg, self.input_shape, num_classes)
        torch.set_rng_state(parts.rng_state)   # the run draws on from where building its parts left off
        self.model: SplitModel = parts.model.to(self.device)
        self.costs, self.method, self.architecture = parts.costs, parts.method, parts.architecture
        task = cfg.task
        self.registry = Registry(num_classes, now=self._now,
                                 channels=task.input_shape[0] if task is not None and task.normalize == "federated"
                                 else None,
                                 architecture=digest(self.architecture) if self.architecture is not None else None)
        self._eval_batch = evaluation_batch(max(c.activation_bytes for c in self.costs.values()), self.device)
        self.options = build_options(cfg, self.model)   # the training options (sfl_core.options), in hook order
        self._round_start: dict[str, torch.Tensor] = {}
        self._terms = ServerTerms()   # what the options asked of this round's server copies
        self._refused: dict[str, str] = {}   # this round's agents whose uploads were refused as invalid, and why
        self._round_wall0 = time.monotonic()   # when the current round began, on this host
        self._latest_width: dict[str, int] = {}          # "split/agent" -> the agent's latest bottleneck width there
        self.server = ServerTrainer(self.model, lr=cfg.lr, momentum=cfg.momentum, device=self.device,
                                    loss=self.server_loss(),
                                    reducer=GradReducer(shards) if shards is not None else None)
        self.session = FleetSession(cfg, transport, self.registry, virtual=clock.virtual, now=self._now,
                                    on_event=self.on_event, on_drop=self.server.drop,
                                    follower=shards is not None and not shards.leader)
        self.start_round = 1
        self.history: list[dict[str, Any]] = []
        if task is not None and isinstance(task.normalize, tuple):
            self._standardise(Normalization(*task.normalize))
        elif task is not None and task.normalize == "none":
            self._standardise(Normalization((0.0,) * task.input_shape[0], (1.0,) * task.input_shape[0]))
        if checkpoint is not None:
            self._resume(*checkpoint)
        if task is not None and not len(self.validation):
            note = ("no validation data on the server (eval.data): the global model's accuracy is measured "
                    + (f"only on the devices' held-out splits, every {cfg.eval.federated_every} round(s)"
                       if cfg.eval.federated_every else "nowhere in this run (no eval.federated_every either)"))
            log.warning(note)
            self.on_event("notice", {"text": note})

    def use_transport(self, transport: Transport) -> None:
        """Connect the engine to its transport once the broker is reached (a deployment builds
        the engine first, so that everything that can refuse a resume is checked before
        anything goes on the wire)."""
        self.transport = transport
        self._now = transport.live_time
        self.registry.now = self._now
        self.session.transport = transport
        self.session._now = self._now

    # ================================================================ public
    def run(self) -> list[dict[str, Any]]:
        """Wait for the fleet, run the remaining rounds, then tell the agents to stop.

        Only a run that finished says stop. On a crash, a signal or a full disk the exception
        propagates and the agents hear nothing: they keep waiting and re-register with the
        coordinator that ``--resume`` starts (a stopped agent would exit 0, and a service
        manager restarts only failed services).
        """
        self.session.wait_for_agents()
        if self.cfg.task is not None and self.normalization is None:
            try:
                self._federated_normalization()
            except NoStatistics as exc:
                raise RoundFailed(str(exc)) from None
        notes: list[Optional[str]] = list(self.method.notes(len(self.registry.agents)))
        notes += [split_note(self.costs, s, self.input_shape) for s in self.method.configured_splits]
        for note in filter(None, notes):
            log.info(note)
            self.on_event("notice", {"text": note})
        if self.start_round == 1:
            self._record_initial()
        for r in range(self.start_round, self.cfg.rounds + 1):
            self.settle_options(r)   # what the method decides of the options the config leaves to it
            self.run_counted_round(r)
        self.shutdown_agents("run finished")
        if self.shards is not None:
            self.shards.broadcast(None)   # the server workers stop
            self.shards.close()
        return self.history

    def serve_shard(self) -> None:
        """A server worker other than the leader: train the rows of this rank's agents, round after
        round, until the leader says the run is over."""
        assert self.shards is not None and not self.shards.leader
        while (doc := self.shards.broadcast()) is not None:
            if "score" in doc:   # the leader scores the model between rounds: this rank's block
                self.score_block(doc["score"])
                continue
            r = doc["round"]
            plan, agents = shard_round.follow(self.shards, self.transport, self.model, doc, self._now)
            mine = list(agents)
            corrections = {a: wire.decode_state(body, self.server_params(plan.splits[a], plan.widths.get(a, 0)))
                           for a, body in doc["corrections"].items()}
            self._terms = ServerTerms(frozen_norms=doc["frozen_norms"], devices_own_norms=doc["devices_own_norms"])
            self.server.begin_round(plan.groups, plan.splits, widths=plan.widths, label_counts=doc["label_counts"],
                                    lr=doc["lr"], population_counts=doc["population"], frozen_norms=doc["frozen_norms"],
                                    corrections=corrections, proximal=doc["proximal"])
            losses = self._train_steps(r, agents, mine)
            log.info("server worker %d: round %d trained %s (last loss %s)", self.shards.rank, r,
                     ", ".join(mine) or "-", f"{losses[-1]:.4f}" if losses else "-")
            self.shards.gather(shard_round.report(agents, self.worker_findings(r)))
        self.shards.close()

    def run_counted_round(self, r: int) -> dict[str, Any]:
        """Run round ``r`` until it trains enough agents to count (see :meth:`_needed`).

        A round whose agents were all dropped (gone, restarted, sending invalid data) is never
        recorded or checkpointed as done: the model goes back to where the round began and the
        round is planned again with whoever is online; after ``ROUND_ATTEMPTS`` plans the run
        stops with :class:`RoundFailed`, the completed rounds safe in the checkpoint.
        """
        self.session.begin_round()
        for attempt in range(1, ROUND_ATTEMPTS + 1):
            snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            widths = {k: pair.infer_width for k, pair in self.model.bottlenecks.items()}
            self._round_start = snapshot   # the server optimiser steps from here
            try:
                return self.run_round(r)
            except (RoundVoid, DeadlinePassed) as void:
                self.model.load_state_dict(snapshot)
                for k, w in widths.items():
                    self.model.bottlenecks[k].infer_width = w
                if attempt < ROUND_ATTEMPTS:
                    log.warning("round %d does not count: %s; not recorded, planning it again (attempt %d of %d)",
                                r, void, attempt + 1, ROUND_ATTEMPTS)
                self.on_event("round_void", {"round": r, "reason": str(void), "attempt": attempt})
                last = str(void)
            finally:
                self.session.deadline = None
        raise RoundFailed(f"round {r} did not count after {ROUND_ATTEMPTS} attempts ({last}); rounds up to "
                          f"{r - 1} are checkpointed: restart with --resume")

    def _needed(self, selected: int) -> int:
        """Completed agents a round needs to count: ``min_completed``, at most the agents selected."""
        return min(self.cfg.min_completed, max(selected, 1))

    def run_round(self, r: int) -> dict[str, Any]:
        apply_readmissions(self.out_dir, self.registry.agents, self._notice)   # an operator's, before selection
        online = self.session.online()     # once: with thousands registered, each count reads them all
        if not online:
            self.session.wait_for_any_agent(r)
            online = self.session.online()
        if self.cfg.stragglers == "replan" and set(online) - set(self.session.late):
            online = [a for a in online if a not in self.session.late]   # planned again without them
        wall0 = self._round_wall0 = time.monotonic()
        self._refused = {}
        selected, batches = self.method.select(r, online, self.registry.agents, self.select(r, online))
        plan = self.method.plan(r, selected, self.registry.agents)
        widen_bottlenecks(self.model, plan, self._latest_width, self.registry.agents)
        self.on_event("round_start", {"round": r, "agents": selected, "phase": plan.phase})
        now = self._now()
        # the round's learning-rate factor: lr_decay's, times each option's
        lr_scale = self.cfg.lr_decay ** max(0, r - 1) * math.prod(o.lr_factor(r) for o in self.options)
        windows = {a: window_for(self.cfg, self.costs, plan, a, self.registry.agents[a]) for a in selected}
        agents = {a: RoundAgent(a, self._assignment(plan.splits[a], plan.widths.get(a, 0), plan.codecs.get(a),
                                                    batches.get(a), lr_scale, windows[a]), last_heard=now,
                                last_sent_at=now, instance=self.registry.agents[a].instance)
                  for a in selected}
        label_counts = {a: self.registry.agents[a].label_counts for a in selected}
        population = {a: i.label_counts for a, i in self.registry.agents.items()}
        # agents holding the whole model train locally and only send weights (FedAvg, or auto's choice)
        split_agents = [a for a, ra in agents.items() if not ra.assignment.whole_model]
        terms = self._terms = ServerTerms()
        for option in self.options:
            option.server_terms(self, r, plan, split_agents, {a: ra.assignment for a, ra in agents.items()}, terms)
        mine = shard_round.lead(self.shards, self.transport, self.model, r, plan, agents, split_agents,
                                label_counts=label_counts, population=population, lr=self.cfg.lr * lr_scale,
                                terms=terms, encode=self.encode_state) if self.shards is not None else split_agents
        self.server.begin_round(plan.groups, plan.splits, widths=plan.widths, label_counts=label_counts,
                                lr=self.cfg.lr * lr_scale, sequential=plan.sequential,
                                member_lr={a: ra.assignment.lr for a, ra in agents.items()}, population_counts=population,
                                frozen_norms=terms.frozen_norms, corrections=terms.corrections, proximal=terms.proximal)
        bodies: dict[tuple[int, int], dict] = {}  # encode each distinct client portion once
        assigns: list[tuple[RoundAgent, Message]] = []
        for a, ra in agents.items():
            key = (ra.assignment.split, ra.assignment.width)
            if key not in bodies:
                bodies[key] = self.encode_state(self.client_state(*key))
            body = ra.assignment.to_body(bodies[key])
            if self.cfg.task is not None and self.normalization is not None:
                body["normalize"] = self.normalization.to_wire()
            for option in self.options:
                body.update(option.assign_fields(self, r, a, *key))
            assigns.append((ra, Message("assign", self.cfg.run_id, protocol.COORDINATOR_ID, body, round=r,
                                        seq=protocol.next_seq())))
        self.session.send_many(assigns)
        self.session.deadline = round_deadline(self.cfg, self.costs, self.registry.agents, agents, len(split_agents),
                                               now=self._now()) if not self.clock.virtual else None
        # server workers step together even in a round without split agents (each step is a collective)
        losses = self._train_steps(r, agents, mine) if split_agents or self.shards is not None else []
        uploads = self.session.collect(agents, "weights", r, self.cfg.local_iters - 1)
        self.session.deadline = None
        if self.shards is not None:
            self.merge_worker_findings(r, shard_round.merge_counters(self.shards, self.transport, agents, mine))
        return self._aggregate_and_record(r, plan, agents, uploads, losses, time.monotonic() - wall0)

    def _train_steps(self, r: int, agents: dict[str, RoundAgent], mine: list[str]) -> list[float]:
        """The round's server steps for the split agents in ``mine`` (all of them, or this server
        worker's shard): gather their activations, train, answer with gradients; the mean losses.
        Server workers step together, rows or not (each step is an all-reduce), so they never
        stop early."""
        losses: list[float] = []
        for k in range(self.cfg.local_iters):
            acts = self.session.collect(agents, "activations", r, k, only=mine)
            if not acts and self.shards is None:
                break
            places = self.server.place_rows({a: (agents[a].assignment.batch_size, *agents[a].assignment.activation_shape)
                                             for a in acts})
            batches = {a: self._batch(agents[a], m, places.get(a)) for a, m in acts.items()}
            for a, b in batches.items():
                if b is not None and b[1] is None:
                    agents[a].labels_withheld = True
            for a in [a for a, b in batches.items() if b is None]:
                self.session.drop(agents, a, "sent invalid activations")
            valid = {a: b for a, b in batches.items() if b is not None}
            if not valid and self.shards is None:
                break
            left_out = self.screen_rows(r, k, agents, valid)   # rows an option will not let in
            let_in = {a: b for a, b in valid.items() if a not in left_out}
            narrowed = self.rows_trained(r, k, let_in)   # rows an option has trained on fewer of
            t0 = time.monotonic()
            for a, rows in narrowed.items():
                x, y = let_in[a]
                let_in[a] = (rows.take(x), None if y is None else rows.take(y))
            grads, loss = self.server.step(let_in, functools.partial(self._exchange_logits, agents, r=r, k=k))
            for a, rows in narrowed.items():
                if a in grads:
                    grads[a] = rows.spread(grads[a])
            grads.update({a: torch.zeros(valid[a][0].shape) for a in left_out})
            dt = time.monotonic() - t0
            if self.server.last_rows:
                losses.append(loss)
            replies = []
            for a, g in grads.items():
                if a not in agents:   # dropped while the server step waited for its logit gradients
                    continue
                agents[a].server_s += dt
                g_body = {"g": wire.encode_tensor(g, agents[a].assignment.codec, self.cfg.zstd_level)}
                replies.append((agents[a], Message("gradients", self.cfg.run_id, protocol.COORDINATOR_ID,
                                                   g_body, round=r, step=k, seq=protocol.next_seq())))
            self.session.send_many(replies)
            self.on_event("step", {"round": r, "step": k + 1, "of": self.cfg.local_iters, "loss": loss})
        return losses

    def shutdown_agents(self, reason: str) -> None:
        """Tell every known agent to stop (the run finished)."""
        self.session.shutdown_agents(reason)

    def rejected_totals(self) -> dict[str, int]:
        """Messages dropped so far, by reason: the transport's (undecodable, spoofed) and the session's."""
        return self.session.rejected_totals()

    def select(self, r: int, online: list[str]) -> list[str]:
        """The round's uniform sample of the ``online`` agents, as the method draws it (its
        ``select`` may then choose otherwise)."""
        if not online:
            raise RuntimeError("no agent is online")
        return self.method.uniform_sample(r, online)

    # ================================================================ internals
    def _assignment(self, split: int, width: int = 0, codec: str | None = None,
                    batch: int | None = None, lr_scale: float = 1.0, window: int = 1) -> Assignment:
        cost = self.costs[split]
        whole = split == self.model.num_blocks
        shape = (self.num_classes,) if whole else cost.activation_shape
        if width:
            shape = bottleneck_shape(shape, width)
        return Assignment(model=self.cfg.model, mode=WHOLE_MODEL if whole else SPLIT_TRAINING, split=split, width=width,
                          batch_size=batch or self.cfg.batch_size,
                          lr=self.method.lr(batch) * lr_scale,
                          momentum=self.cfg.momentum,
                          tau=self.cfg.local_iters, codec=codec or self.cfg.codec, zstd_level=self.cfg.zstd_level,
                          activation_shape=tuple(shape), window=1 if whole else min(window, self.cfg.local_iters))

    def _batch(self, ra: RoundAgent, msg: Message, place: Optional[torch.Tensor] = None
               ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The activations and labels of ``msg``, validated (None, rejected, if invalid) and on
        their way to the server's device (the copy overlaps decoding the next agent's);
        ``place``: where in the step's merged batch to decode the activations."""
        try:
            batch = decode_activations(msg.body, ra.assignment, self.num_classes, out=place)
        except wire.WireError as exc:
            self.session.rejections.reject("invalid", f"activations from {ra.info_id}: {exc}")
            self._refused[ra.info_id] = "invalid activations"
            return None
        return self.server.stage(batch)

    def _exchange_logits(self, agents: dict[str, RoundAgent], logits: dict[str, torch.Tensor], r: int,
                         k: int) -> dict[str, tuple[torch.Tensor, float]]:
        """Labels withheld: send each such agent its rows' logits, collect the gradient of its
        mean loss w.r.t. them (validated: shape, finite) and its loss."""
        asked = {a: agents[a] for a in logits if a in agents}
        for a, ra in asked.items():
            self.session.send(ra, Message("logits", self.cfg.run_id, protocol.COORDINATOR_ID,
                                          {"z": wire.encode_tensor(logits[a], "fp32", self.cfg.zstd_level)},
                                          round=r, step=k, seq=protocol.next_seq()))
        replies = self.session.collect(agents, "logit_grads", r, k, only=list(asked))
        out: dict[str, tuple[torch.Tensor, float]] = {}
        for a in logits:
            if a not in agents:          # dropped while we waited: out of the round
                continue
            try:
                g, loss = decode_logit_gradients(replies[a].body, tuple(logits[a].shape))
            except wire.WireError as exc:
                self.session.rejections.reject("invalid", f"logit gradients from {a}: {exc}")
                self._refused[a] = "invalid logit gradients"
                self.session.drop(agents, a, "sent invalid logit gradients")
                continue
            out[a] = (g, loss)
        return out

    # ================================================================ round end
    def _aggregate_and_record(self, r: int, plan: RoundPlan, agents: dict[str, RoundAgent],
                              uploads: dict[str, Message], losses: list[float], wall_s: float) -> dict[str, Any]:
        """The end of a round: aggregate, evaluate, price each agent's round by the clock, then
        record and checkpoint it (:mod:`coordinator.round_record`). ``wall_s``: the training phase's
        wall seconds (what a wall clock charges); the record's ``wall_s`` is the whole round on this
        host, aggregation and evaluation included, and ``eval_s`` the evaluation's part."""
        done, fed_losses = self._aggregate(r, plan, agents, uploads)
        phases = {}
        for option in self.options:   # a phase of its own after aggregation (a statistics pass)
            phase = option.phase(self, r, {a: agents[a].assignment for a in done if a in agents})
            if phase is not None:
                phases[option.SECTION.KEY] = phase
        for option in self.options:
            option.after_round(self, r)
        eval0 = time.monotonic()
        accuracy, test_loss = self.evaluate() if self._evaluates(r) else (None, None)
        eval_s = time.monotonic() - eval0
        per_agent, times, observed = price_round(r, self.clock, self.costs, self.registry.agents, agents, uploads,
                                                 done, server_flops=self.cfg.server_flops,
                                                 per_agent_step_s=self.cfg.agent_step_overhead_s)
        self.method.observe(observed)
        round_s = self.clock.end_round(list(times.values()), wall_s)
        self.method.record(r, times, plan.splits, round_s)
        phase_records = {}
        for key, phase in phases.items():   # each starts once the slowest agent's weights are in
            rec = price_phase(r, self.clock, self.costs, self.registry.agents, phase.agents,
                              samples=phase.samples, server_flops=self.cfg.server_flops)
            rec["time_s"] = self.clock.end_round(rec.pop("times").values(), phase.wall_s)
            round_s += rec["time_s"]
            phase_records[key] = rec
        train_loss = (sum(losses) / len(losses)) if losses else (sum(fed_losses) / len(fed_losses) if fed_losses else None)
        federated = self._federated_evaluation(r, agents, done)
        record = round_record(
            r, accuracy=accuracy, test_loss=test_loss, train_loss=train_loss, round_s=round_s,
            elapsed_s=self.clock.elapsed, virtual=self.clock.virtual,
            wall_s=time.monotonic() - self._round_wall0, eval_s=eval_s, times=times,
            per_agent=per_agent, plan=plan, done=done, rejected=self.session.rejected_since_last_round(),
            federated=federated, method_metrics={**self.method.round_metrics(), **self._option_metrics()},
            phases=phase_records)
        if self.session.resent:
            record["resent"] = self.session.resent
            self.session.report_losses(r, agents)
        if self.session.late or self.session.stalled:
            record["stragglers"] = {"policy": self.cfg.stragglers, "late": sorted(set(self.session.late)),
                                    "busy": sorted(set(self.session.stalled))}
        self.history.append(record)
        self.session.prune()   # silent agents that never trained stay out of the checkpoint
        ckpt.append_metrics(self.out_dir, record)
        ckpt.save(self.out_dir, {**self.model.state_dict(), **{k: t for o in self.options
                                                               for k, t in o.state_tensors().items()}},
                  self._checkpoint_state(r), encoded={"registry": self.registry.to_json_text()})
        self.on_event("round_end", record)
        return record
