"""The agent's protocol state machine, independent of any transport.

``AgentCore.handle(message) -> replies`` is all a transport needs: the MQTT runner feeds it
messages from the broker, the in-process simulation feeds it messages directly. Keeping
the state machine free of I/O is what lets one round engine drive both.

Exactly-once training under retransmission: each (round, step) gradient is applied at most
once. A duplicate assignment or gradient (the coordinator retransmits when it suspects a
loss) is answered by re-sending the last reply, never by training again.

Steps in flight (the assignment's ``window``): the agent sends up to ``window`` steps'
activations before the first one's gradients come back, and applies each gradient, in step
order, as it arrives. A step computed while others are in flight keeps the weights it was
computed with (PipeDream's weight stashing), so its gradient is exact for them; it lands on
weights at most ``window - 1`` updates newer. Window 1 is lock-step, computed exactly as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.func import functional_call

from sfl_core import option_registry
from sfl_core.data.preprocessing import Normalization
from sfl_core.model.accounting import model_costs
from sfl_core.model.zoo import SplitModel, build_model
from sfl_core.step_terms import StepTerms
from sfl_core.privacy import (
    AgentPrivacy,
    clip_and_noise,
    clip_scales,
    distance_correlation,
    dp_epsilon,
    dp_sgd_gradients,
    protect_label_grads,
)
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import Assignment
from sfl_core.wire.protocol import Message
from sfl_core.wire.requests import EvaluateRequest

log = logging.getLogger("sfl.agent")

ComputeHook = Callable[[float, float], float]
"""(flops just done, seconds they took) -> seconds to report; emulation sleeps in here."""


@dataclass
class LocalData:
    """The agent's private shard; it never leaves the device."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def label_counts(self) -> list[int]:
        return torch.bincount(self.y, minlength=self.num_classes).tolist()


@dataclass
class InFlight:
    """One step whose activations went out and whose gradients have not been applied."""

    step: int
    out: torch.Tensor
    """What was sent (clipped and noised if asked), with its graph back to the client portion."""
    leak: Optional[torch.Tensor]
    """NoPeek's term for this step (None when off)."""
    sent: Message
    stash: Optional[dict[str, torch.Tensor]]
    """The weights it was computed with, where other steps update the live ones before its
    gradient comes (None: computed with the live weights, nothing stepped since)."""


class BatchSampler:
    """Reshuffled epochs over the shard, seeded so a run is reproducible."""

    def __init__(self, n: int, seed: int):
        self._n = n
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(n, generator=self._gen)
        self._pos = 0

    def next(self, batch_size: int) -> torch.Tensor:
        idx: list[torch.Tensor] = []
        have = 0
        while have < batch_size:
            if self._pos >= self._n:
                self._order = torch.randperm(self._n, generator=self._gen)
                self._pos = 0
            take = min(batch_size - have, self._n - self._pos)
            idx.append(self._order[self._pos:self._pos + take])
            self._pos += take
            have += take
        return torch.cat(idx) if len(idx) > 1 else idx[0]


class AgentCore:
    def __init__(self, agent_id: str, run_id: str, data: LocalData, input_shape: tuple[int, ...],
                 *, seed: int = 0, compute_hook: Optional[ComputeHook] = None, device: str | torch.device = "cpu",
                 privacy: AgentPrivacy = AgentPrivacy(), standardise: bool = False,
                 held_out: Optional[LocalData] = None):
        """``privacy``: what this agent keeps back (labels) and the defenses it applies to what
        leaves (:mod:`sfl_core.privacy`); the coordinator needs to know nothing of them.
        ``standardise``: ``data.x`` is scaled but not standardised; every assignment carries the
        run's constants (``normalize``), applied before training (a task run's own data).
        ``held_out``: the device's held-out split, scored for federated evaluation (``evaluate``)."""
        self.agent_id = protocol.check_id("agent id", agent_id)
        self.run_id = run_id
        self.device = torch.device(device)  # simulations may put in-process agents on the GPU
        if self.device.type != "cpu":
            data = LocalData(data.x.to(self.device), data.y.to(self.device), data.num_classes)
            if held_out is not None:
                held_out = LocalData(held_out.x.to(self.device), held_out.y.to(self.device), held_out.num_classes)
        self.data = data
        self.held_out = held_out
        self._scaled = data.x if standardise else None
        self._scaled_held_out = held_out.x if standardise and held_out is not None else None
        self._evaluated: tuple[int, int] = (-1, -1)       # (round, seq) of the last evaluate answered
        self._seed = seed
        self._streams: dict[int, BatchSampler] = {}      # an option's batches (a stream each: training's stay)
        self.normalization: Optional[Normalization] = None
        self.input_shape = tuple(input_shape)
        self._sampler = BatchSampler(len(data), seed)
        self._compute_hook = compute_hook
        self._models: dict[tuple[str, int, int], SplitModel] = {}
        # per-round state
        self.round = -1
        self.step = -1
        self._assign: Optional[Assignment] = None
        self._client: Optional[torch.nn.Module] = None
        self._opt: Optional[torch.optim.Optimizer] = None
        self._terms = StepTerms([])   # what the training options add to every step's gradients
        self._options = [d for d in (o.device() for o in option_registry.option_classes()) if d is not None]
        """Each training option's part on this device (sfl_core.options), kept across rounds."""
        self._handlers = {t: h for d in self._options for t, h in d.handles().items()}
        self._flight: deque[InFlight] = deque()   # steps sent, gradients not yet applied (oldest first)
        self._early_grads: dict[int, torch.Tensor] = {}   # a later step's gradient, in before an earlier one's
        self._window = 1                                   # steps this round keeps in flight
        self.privacy = privacy
        self._x: Optional[torch.Tensor] = None           # this step's inputs (DP-SGD recomputes per sample)
        self._scale: Optional[torch.Tensor] = None       # this step's activation clipping factors
        self._noise_gen = torch.Generator().manual_seed(seed + 7919)
        self.dp_steps: dict[float, int] = {}             # DP-SGD: sample rate -> steps taken at it
        # labels withheld (MergeSFL): the coordinator sends our rows' logits, we score them here
        self.withhold_labels = privacy.withhold_labels
        self._y: Optional[torch.Tensor] = None
        self._scored_step = -1
        self._flops_per_sample = 0.0
        self._compute_s = 0.0
        self._last_reply: Optional[Message] = None
        self._assign_seq = -1
        self.rounds_done = 0

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: Message) -> list[Message]:
        """Apply one coordinator message; return the replies to send (possibly none)."""
        if msg.type == "assign":
            return self._on_assign(msg)
        if msg.type == "gradients":
            return self._on_gradients(msg)
        if msg.type == "logits":
            return self._on_logits(msg)
        if msg.type == "evaluate":
            return self._on_evaluate(msg)
        if msg.type in self._handlers:   # a training option's own request (a statistics pass)
            return self._handlers[msg.type](self, msg)
        log.debug("agent %s ignores %s", self.agent_id, msg.type)
        return []

    @property
    def assignment(self) -> Optional[Assignment]:
        """The round's assignment being (or last) executed."""
        return self._assign

    @property
    def window(self) -> int:
        """Steps the round keeps in flight: the assignment's, or 1 where this agent withholds its
        labels or runs DP-SGD (a defense on the step just sent)."""
        return self._window

    def last_reply(self) -> Optional[Message]:
        """What to retransmit when the coordinator has gone quiet."""
        return self._last_reply

    # ------------------------------------------------------------------ assign
    def _on_assign(self, msg: Message) -> list[Message]:
        if msg.round < self.round or (msg.round == self.round and msg.seq == self._assign_seq):
            log.info("duplicate assignment for round %d: re-sending last reply", msg.round)
            return self._resend()
        # same round with a new seq: the coordinator restarted the round (e.g. after --resume)
        a = Assignment.from_body(msg.body)
        self._standardise(msg.body.get("normalize"))
        model = self._model(a.model, a.split, a.width)
        model.check_split(a.split)
        if a.whole_model and a.split != model.num_blocks:
            raise wire.WireError("assign.split: fedavg needs the whole model on the agent")
        client = model.client(a.split)
        state = wire.decode_state(msg.body["weights"], {k: v.cpu() for k, v in model.client_state(a.split).items()})
        model.load_state_dict(state, strict=False)
        self._assign, self._client = a, client
        self._client.train()
        extra: dict[int, torch.Tensor] = {}
        for option in self._options:   # the assignment's fields were range-checked with the schema
            extra.update({id(p): t for p, t in option.on_assign(msg.body, model, a.split, client, state)})
        self._opt = torch.optim.SGD(client.parameters(), lr=a.lr, momentum=a.momentum)
        keys = set(model.client_keys(a.split))
        self._terms = StepTerms([(p, extra.get(id(p))) for n, p in model.named_parameters() if n in keys],
                                sum(option.proximal(msg.body) for option in self._options))
        self._flops_per_sample = model_costs(a.model, self.input_shape, self.data.num_classes)[a.split].client_flops
        self.round, self.step, self._compute_s, self._assign_seq = msg.round, -1, 0.0, msg.seq
        self._flight.clear()
        self._early_grads.clear()
        if a.whole_model:
            return self._remember([self._train_locally()])
        # labels withheld and DP-SGD work on the step just sent: they keep lock-step
        lockstep = self.withhold_labels or self.privacy.dp_sgd is not None
        self._window = 1 if lockstep else max(1, min(a.window, a.tau))
        return self._remember([self._forward_next() for _ in range(self._window)])

    def _standardise(self, constants: Optional[dict]) -> None:
        """Standardise our inputs with the run's constants (once; again only if they change)."""
        if self._scaled is None:
            if constants is not None:
                raise wire.WireError("assign.normalize: this agent's data comes standardised (a built-in data set)")
            return
        if constants is None:
            raise wire.WireError("assign.normalize: missing; this run standardises with the fleet's constants")
        norm = Normalization.from_wire(constants, self._scaled.shape[1], "assign.normalize")
        if norm != self.normalization:
            self.data = LocalData(norm.apply(self._scaled), self.data.y, self.data.num_classes)
            if self.held_out is not None and self._scaled_held_out is not None:
                self.held_out = LocalData(norm.apply(self._scaled_held_out), self.held_out.y, self.held_out.num_classes)
            self.normalization = norm

    # ------------------------------------------------------------------ split training
    def _forward_next(self) -> Message:
        assert self._assign is not None and self._client is not None
        self.step += 1
        idx = self._sampler.next(self._assign.batch_size)
        x, y = self.data.x[idx], self.data.y[idx]
        t0 = time.perf_counter()
        stash = self._stash() if self._flight else None
        out = self._client(x) if stash is None else functional_call(self._client, stash, (x,))
        self._y = y
        sent, leak = self._protect(x, out)
        self._x = x if self.privacy.dp_sgd is not None else None
        # forward is about a third of forward+backward FLOPs; the rest is charged at backward
        self._charge(self._flops_per_sample * len(idx) / 3, time.perf_counter() - t0)
        if tuple(out.shape[1:]) != self._assign.activation_shape:
            raise wire.WireError(f"assign.activation_shape {self._assign.activation_shape} does not match this "
                                 f"model's client output {tuple(out.shape[1:])}")
        msg = self._msg("activations", step=self.step, body={
            "x": wire.encode_tensor(sent, self._assign.codec, self._assign.zstd_level),
            "y": None if self.withhold_labels else wire.encode_tensor(y.to(torch.int64), "fp32", self._assign.zstd_level),
            "compute_s": self._compute_s,
        })
        self._flight.append(InFlight(self.step, sent, leak, msg, stash))
        return msg

    def _stash(self) -> dict[str, torch.Tensor]:
        """A copy of the client portion's weights for a step computed while others are in flight:
        their updates land on the live weights before its gradient comes back."""
        assert self._client is not None
        return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self._client.named_parameters()}

    def _protect(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """What is sent for the client's output ``out`` of inputs ``x`` (clipped and noised if
        asked), and NoPeek's loss term (None when off or for a single-sample batch)."""
        p = self.privacy
        leak = p.nopeek * distance_correlation(x, out) if p.nopeek > 0 and x.shape[0] > 1 else None
        if p.activation_noise is None:
            self._scale = None
            return out, leak
        self._scale = clip_scales(out, p.activation_noise.clip)   # DP-SGD clips the gradient through it alike
        return clip_and_noise(out, p.activation_noise, self._noise_gen), leak

    def _on_gradients(self, msg: Message) -> list[Message]:
        a = self._assign
        if a is None or msg.round != self.round or not self._flight:
            if msg.round <= self.round:
                return self._resend()  # late duplicate: our reply may have been lost
            raise wire.WireError(f"gradients for round {msg.round} without an assignment")
        oldest = self._flight[0].step
        if msg.step < oldest:
            return self._resend()      # already applied: never apply a gradient twice
        if msg.step > self._flight[-1].step:   # beyond the steps in flight (lock-step: past the one)
            raise wire.WireError(f"gradients for step {msg.step}, expected {oldest}")
        if msg.step in self._early_grads:
            return []                  # a resent copy of one we hold
        out = self._flight[msg.step - oldest].out
        g = wire.decode_tensor(msg.body["g"], shape=tuple(out.shape), dtypes=("float32", "float16")).to(self.device)
        if not wire.all_finite(g):
            raise wire.WireError("gradients contain NaN or Inf")
        self._early_grads[msg.step] = g
        replies: list[Message] = []
        while self._flight and self._flight[0].step in self._early_grads:   # in step order
            f = self._flight.popleft()
            replies += self._backward(f, self._early_grads.pop(f.step))
        return self._remember(replies)

    def _backward(self, f: InFlight, g: torch.Tensor) -> list[Message]:
        """Apply step ``f``'s gradient ``g``; then send the next step, or the weights after the last."""
        a = self._assign
        assert a is not None and self._opt is not None and self._client is not None
        t0 = time.perf_counter()
        self._opt.zero_grad(set_to_none=True)
        if self.privacy.dp_sgd is not None:
            self._dp_backward(g)
        elif f.leak is not None:   # NoPeek: the server's gradient plus our own leakage term
            torch.autograd.backward([f.out, f.leak], [g, None])
        else:
            f.out.backward(g)
        if f.stash is not None:    # computed with stashed weights: their gradient is the live weights'
            for n, p in self._client.named_parameters():
                p.grad = f.stash[n].grad
        self._terms.apply()   # the training options' terms (drift correction)
        self._opt.step()
        self._x = None
        self._charge(self._flops_per_sample * g.shape[0] * 2 / 3, time.perf_counter() - t0)
        if self.step + 1 < a.tau:
            return [self._forward_next()]
        if not self._flight:
            return [self._weights_message(loss=float("nan"))]
        return []

    def _on_logits(self, msg: Message) -> list[Message]:
        """Labels withheld: score our rows' logits with the labels we kept and return the
        gradient of our mean loss w.r.t. them (the coordinator backpropagates it)."""
        if self._assign is None or msg.round != self.round or self._y is None or not self.withhold_labels:
            if msg.round <= self.round:
                return self._resend()
            raise wire.WireError(f"logits for round {msg.round} without an assignment")
        if msg.step < self.step or (msg.step == self.step and self._scored_step == self.step):
            return self._resend()      # our reply was lost
        if msg.step > self.step:
            raise wire.WireError(f"logits for step {msg.step}, expected {self.step}")
        z = wire.decode_tensor(msg.body["z"], shape=(len(self._y), self.data.num_classes),
                               dtypes=("float32", "float16")).to(self.device)
        if not wire.all_finite(z):
            raise wire.WireError("logits contain NaN or Inf")
        z.requires_grad_(True)
        loss = F.cross_entropy(z, self._y)
        (g,) = torch.autograd.grad(loss, z)
        if self.privacy.label_protection is not None:
            g = protect_label_grads(g, self.privacy.label_protection, self._noise_gen)
        self._scored_step = self.step
        return self._remember([self._msg("logit_grads", step=self.step, body={
            "g": wire.encode_tensor(g, "fp32", self._assign.zstd_level), "loss": loss.item(),
            "compute_s": self._compute_s})])

    # ------------------------------------------------------------------ DP-SGD
    def _dp_backward(self, g: torch.Tensor) -> None:
        """The server's gradient, sample by sample: row i of ``g`` (times our batch size, which
        makes it the gradient of the sample's own loss when we are the whole merged batch)
        is what sample i contributes; clipping each contribution bounds any one sample's
        influence whatever the merged batch was."""
        assert self._x is not None
        if self._scale is not None:   # the activations were clipped: so is the gradient through them
            g = g * self._scale.view(-1, *([1] * (g.dim() - 1)))
        self._dp_sgd_step(self._x, g * g.shape[0], lambda out, gi: (out * gi).sum())

    def _dp_sgd_step(self, x: torch.Tensor, target: torch.Tensor, loss) -> None:
        assert self._client is not None and self.privacy.dp_sgd is not None
        try:
            dp_sgd_gradients(self._client, x, target, loss, self.privacy.dp_sgd, self._noise_gen)
        except ValueError as exc:   # a client portion DP-SGD cannot handle: the assignment cannot be run
            raise wire.WireError(str(exc)) from None
        rate = round(x.shape[0] / len(self.data), 6)
        self.dp_steps[rate] = self.dp_steps.get(rate, 0) + 1

    def epsilon(self) -> Optional[float]:
        """DP-SGD's epsilon so far, at the configured delta (None without DP-SGD)."""
        dp = self.privacy.dp_sgd
        return None if dp is None else dp_epsilon(self.dp_steps, dp.sigma, dp.delta)

    # ------------------------------------------------------------------ fedavg
    def _train_locally(self) -> Message:
        """FedAvg baseline: tau SGD steps on the whole model, loss computed on the device."""
        assert self._assign is not None and self._client is not None and self._opt is not None
        total = 0.0
        for _ in range(self._assign.tau):
            idx = self._sampler.next(self._assign.batch_size)
            t0 = time.perf_counter()
            self._opt.zero_grad(set_to_none=True)
            x, y = self.data.x[idx], self.data.y[idx]
            if self.privacy.dp_sgd is not None:
                with torch.no_grad():
                    loss = F.cross_entropy(self._client(x), y)
                self._dp_sgd_step(x, y, lambda out, t: F.cross_entropy(out.unsqueeze(0), t.unsqueeze(0)))
            else:
                loss = F.cross_entropy(self._client(x), y)
                loss.backward()
            self._terms.apply()   # the training options' terms (drift correction)
            self._opt.step()
            self._charge(self._flops_per_sample * len(idx), time.perf_counter() - t0)
            total += loss.item()
        self.step = self._assign.tau - 1
        return self._weights_message(loss=total / self._assign.tau)

    # ------------------------------------------------------------------ helpers
    def _weights_message(self, loss: float) -> Message:
        assert self._assign is not None
        model = self._model(self._assign.model, self._assign.split, self._assign.width)
        self._assign_done()
        trained = model.client_state(self._assign.split)
        for option in self._options:
            option.on_trained(model, trained)
        body = {
            "weights": wire.encode_state(trained, self._assign.zstd_level),
            "num_samples": len(self.data),
            "compute_s": self._compute_s,
            "loss": loss,
        }
        eps = self.epsilon()
        if eps is not None and self.privacy.dp_sgd is not None:
            body["epsilon"] = eps
            log.info("DP-SGD after round %d: epsilon %.3g at delta %g (%d steps)", self.round, eps,
                     self.privacy.dp_sgd.delta, sum(self.dp_steps.values()))
        return self._msg("weights", step=self.step, body=body)

    def _assign_done(self) -> None:
        self.rounds_done += 1

    def _charge(self, flops: float, seconds: float) -> None:
        if self._compute_hook is not None:
            seconds = self._compute_hook(flops, seconds)
        self._compute_s += seconds

    # ------------------------------------------------------------------ federated evaluation
    @torch.no_grad()
    def _on_evaluate(self, msg: Message) -> list[Message]:
        """Score the global model on our held-out split; only loss, correct and count leave."""
        if (msg.round, msg.seq) == self._evaluated or msg.round < self._evaluated[0]:
            return self._resend()
        self._standardise(msg.body.get("normalize"))
        request = EvaluateRequest.from_body(msg.body)
        torch.manual_seed(0)   # structure only; the weights come with the message
        model = build_model(request.model, self.input_shape, self.data.num_classes)
        for split, width, infer_width in request.bottlenecks:
            model.check_split(split)
            model.add_bottleneck(split, width).infer_width = min(width, infer_width)
        state = wire.decode_state(request.weights, {k: v for k, v in model.state_dict().items()})
        model.load_state_dict(state)
        model.to(self.device).eval()
        t0 = time.perf_counter()
        loss, correct, count = 0.0, 0, 0
        data = self.held_out
        if data is not None:
            for i in range(0, len(data), 256):
                x, y = data.x[i:i + 256], data.y[i:i + 256]
                logits = model(x)
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
                count += len(y)
        self._evaluated = (msg.round, msg.seq)
        reply = Message("evaluation", self.run_id, self.agent_id, round=msg.round, step=msg.step,
                        seq=protocol.next_seq(), body={"loss": loss / max(count, 1), "correct": correct,
                                                       "count": count, "compute_s": time.perf_counter() - t0})
        return self._remember([reply])

    def option(self, kind: type) -> Any:
        """This device's part of a training option, of class ``kind``."""
        return next((o for o in self._options if isinstance(o, kind)), None)

    # ------------------------------------------------------------------ what options use (DeviceContext)
    @property
    def noise_generator(self) -> torch.Generator:
        return self._noise_gen

    def standardise(self, constants: Optional[dict]) -> None:
        self._standardise(constants)

    def model(self, name: str, split: int, width: int) -> SplitModel:
        return self._model(name, split, width)

    def batch(self, stream: int, batch_size: int) -> torch.Tensor:
        if stream not in self._streams:
            self._streams[stream] = BatchSampler(len(self.data), self._seed + stream)
        return self._streams[stream].next(batch_size)

    def compute_seconds(self, flops: float, seconds: float) -> float:
        return self._compute_hook(flops, seconds) if self._compute_hook is not None else seconds

    def resend(self) -> list[Message]:
        return self._resend()

    def remember(self, replies: list[Message]) -> list[Message]:
        return self._remember(replies)

    def _model(self, name: str, split: int, width: int) -> SplitModel:
        """The model structure for an assignment (a bottleneck of ``width`` at ``split`` if width > 0)."""
        key = (name, split, width) if width else (name, 0, 0)
        if key not in self._models:
            torch.manual_seed(0)  # structure only; the weights arrive with the assignment
            model = build_model(name, self.input_shape, self.data.num_classes)
            if width:
                model.add_bottleneck(split, width)
            self._models[key] = model.to(self.device)
        return self._models[key]

    def _msg(self, mtype: str, *, step: int, body: dict) -> Message:
        return Message(type=mtype, run=self.run_id, sender=self.agent_id, body=body,
                       round=self.round, step=step, seq=protocol.next_seq())

    def _remember(self, replies: list[Message]) -> list[Message]:
        if replies:
            self._last_reply = replies[-1]
        return replies

    def _resend(self) -> list[Message]:
        """What the coordinator may have lost: our last reply, sent as it was (its seq marks it
        as a retransmission). With steps in flight, any of them may be the one lost, and each goes
        again under a new seq: the coordinator may already hold the later ones, and their seqs
        would make the original's a replay, refused, so the step would never arrive."""
        if self._window > 1 and self._flight:
            return [replace(f.sent, seq=protocol.next_seq()) for f in self._flight]
        return [self._last_reply] if self._last_reply is not None else []
