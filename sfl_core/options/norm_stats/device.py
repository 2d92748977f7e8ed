"""The BatchNorm statistics option on the device (:mod:`.option`): FixBN's frozen layers, FedBN's
own layers, and the statistics pass (``norm_pass``): run local batches through the new global
client portion without training and report its BatchNorm layers' input moments and the
activations. No label leaves; activation noise applies as in training."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from sfl_core.model.accounting import model_costs
from sfl_core.model.norm_layers import freeze
from sfl_core.options.base import DeviceOption
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.exchange import PassRequest
from sfl_core.privacy import clip_and_noise
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message

if TYPE_CHECKING:
    from sfl_core.model.zoo import SplitModel
    from sfl_core.options.base import DeviceContext

__all__ = ["NormStatsOnDevice", "answer_pass"]

SAMPLER_SEED = 104729
"""The pass draws its batches from a stream of its own (the training batches stay as they are)."""


def answer_pass(state: "NormStatsOnDevice", agent: "DeviceContext", msg: Message) -> list[Message]:
    if (msg.round, msg.seq) == state.passed or msg.round < state.passed[0]:
        return agent.resend()
    agent.standardise(msg.body.get("normalize"))
    req = PassRequest.from_body(msg.body)
    model = agent.model(req.model, req.split, req.width)
    model.check_split(req.split)
    whole = req.split == model.num_blocks
    state_dict = wire.decode_state(req.weights, {k: v.cpu() for k, v in model.client_state(req.split).items()})
    model.load_state_dict(state_dict, strict=False)
    t0 = time.perf_counter()
    xs = [agent.data.x[agent.batch(SAMPLER_SEED, req.batch_size)] for _ in range(req.batches)]
    moments, outs = norm_stats.collect(model, model.client(req.split), xs)
    seconds = time.perf_counter() - t0
    samples = req.batches * req.batch_size
    flops = model_costs(req.model, agent.input_shape, agent.data.num_classes)[req.split].client_flops * samples / 3
    compute_s = agent.compute_seconds(flops, seconds)
    x = None
    if not whole:
        out = torch.cat(outs)
        if tuple(out.shape[1:]) != req.activation_shape:
            raise wire.WireError(f"norm_pass.activation_shape {list(req.activation_shape)} does not match this "
                                 f"model's client output {tuple(out.shape[1:])}")
        if agent.privacy.activation_noise is not None:
            out = clip_and_noise(out, agent.privacy.activation_noise, agent.noise_generator)
        x = wire.encode_tensor(out, req.codec, req.zstd_level)
    tensors, counts = norm_stats.to_wire_state(moments)
    state.passed = (msg.round, msg.seq)
    reply = Message("norm_sums", agent.run_id, agent.agent_id, round=msg.round, step=msg.step,
                    seq=protocol.next_seq(), body={"moments": wire.encode_state(tensors, req.zstd_level),
                                                   "counts": counts, "x": x, "compute_s": compute_s})
    return agent.remember([reply])


class NormStatsOnDevice(DeviceOption):
    """FixBN freezes the client portion's BatchNorm layers; FedBN keeps this device's own layers
    from one round to the next (in memory: a restarted agent starts from the global ones); a
    statistics pass runs the new client portion over local batches without training."""

    def __init__(self) -> None:
        self.own: dict[str, torch.Tensor] = {}
        self.local = False
        self.passed: tuple[int, int] = (-1, -1)    # (round, seq) of the last norm_pass answered

    def on_assign(self, fields: Mapping[str, Any], model: "SplitModel", split: int, client: torch.nn.Module,
                  weights: Mapping[str, torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        self.local = bool(fields.get("local_norm"))
        if self.local:   # our own normalisation layers replace the global ones we hold
            model.load_state_dict({k: v for k, v in self.own.items()
                                   if k in weights and weights[k].shape == v.shape}, strict=False)
        if fields.get("freeze_norm"):
            freeze(client)
        return []

    def on_trained(self, model: "SplitModel", state: Mapping[str, torch.Tensor]) -> None:
        if self.local:
            self.own.update(norm_stats.local_entries(model, state))

    def handles(self) -> Mapping[str, Callable[..., Any]]:
        return {"norm_pass": lambda agent, msg: answer_pass(self, agent, msg)}
