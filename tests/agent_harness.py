"""A tiny in-test coordinator that drives an :class:`AgentCore` by hand, the way the round
engine does: assignments with real client-portion weights, gradients from a real server
portion (:class:`coordinator.server_trainer.ServerTrainer`), every message through the real
wire codec. A plain module (not a test module), so tests import it instead of each other."""

from __future__ import annotations

import torch

from coordinator.server_trainer import ServerTrainer
from edge_agent.agent import AgentCore, LocalData
from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.wire.assignment import Assignment
from sfl_core.model.zoo import build_model
from sfl_core.wire.protocol import Message

RUN = "run-t"
AGENT = "agent-1"
MODEL = "small_cnn"
ACT_SHAPE = {1: (16, 8, 8), 2: (32, 4, 4), 3: (64,), 4: ()}


def through_wire(msg: Message) -> Message:
    """Through the real codec, as a transport would carry it."""
    return protocol.decode(msg.encode(), run=RUN)


def make_agent(digits, n: int = 300, seed: int = 0, **kw) -> AgentCore:
    data = LocalData(digits.x_train[:n], digits.y_train[:n], digits.num_classes)
    return AgentCore(AGENT, RUN, data, digits.input_shape, seed=seed, **kw)


class Coordinator:
    """Just enough of the round engine: assign, serve gradients, take weights back."""

    def __init__(self, digits, split: int = 2, lr: float = 0.05, seed: int = 1, momentum: float = 0.0):
        torch.manual_seed(seed)
        self.model = build_model(MODEL, digits.input_shape, digits.num_classes)
        self.split = split
        self.trainer = ServerTrainer(self.model, lr=lr, momentum=momentum)
        self.seq = protocol.Sequencer(start=1)
        self.losses: list[float] = []

    def assign(self, rnd: int, *, tau: int = 4, batch: int = 16, strategy: str = "sfl",
               codec: str = "fp32", lr: float = 0.05, momentum: float = 0.0) -> Message:
        a = Assignment(model=MODEL, mode=strategy, split=self.split, width=0, batch_size=batch, lr=lr,
                       momentum=momentum, tau=tau, codec=codec, zstd_level=1, activation_shape=ACT_SHAPE[self.split])
        self.trainer.begin_round([[AGENT]], {AGENT: self.split})
        body = a.to_body(wire.encode_state(self.model.client_state(self.split)))
        return through_wire(Message("assign", RUN, protocol.COORDINATOR_ID, body, round=rnd, seq=self.seq.next()))

    def gradients(self, act: Message) -> Message:
        assert act.type == "activations"
        x = wire.decode_tensor(act.body["x"], shape=(None, *ACT_SHAPE[self.split]), dtypes=("float32", "float16"))
        y = wire.decode_tensor(act.body["y"], shape=(x.shape[0],), dtypes=("int64",))
        grads, loss = self.trainer.step({act.sender: (x, y)})
        self.losses.append(loss)
        return through_wire(Message("gradients", RUN, protocol.COORDINATOR_ID, {"g": wire.encode_tensor(grads[act.sender])},
                             round=act.round, step=act.step, seq=self.seq.next()))

    def take_weights(self, msg: Message) -> None:
        assert msg.type == "weights"
        state = wire.decode_state(msg.body["weights"], self.model.client_state(self.split))
        state.update(self.trainer.member_state(msg.sender, self.split))  # the round's trained server side
        self.model.load_state_dict(state)

    def accuracy(self, digits) -> float:
        self.model.eval()
        with torch.no_grad():
            acc = (self.model(digits.x_test).argmax(1) == digits.y_test).float().mean().item()
        self.model.train()
        return acc


def send(agent: AgentCore, msg: Message) -> list[Message]:
    return [through_wire(r) for r in agent.handle(msg)]


def client_weights(agent: AgentCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in agent._client.state_dict().items()}  # noqa: SLF001 (white-box check)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_round(agent: AgentCore, coord: Coordinator, rnd: int, tau: int, **kw) -> Message:
    (reply,) = send(agent, coord.assign(rnd, tau=tau, **kw))
    while reply.type == "activations":
        (reply,) = send(agent, coord.gradients(reply))
    coord.take_weights(reply)
    return reply
