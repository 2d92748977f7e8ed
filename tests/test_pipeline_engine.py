"""Steps in flight through the round engine (in one process, the virtual clock): a window hides
the link on a link-bound fleet and the run learns as in lock-step; the metrics say what each
agent kept in flight and what it hid; ``window: auto`` under ``strategy: auto`` plans it with
the cut and the batch; a gradient lost with steps in flight is recovered by the agent's idle
heartbeat and the coordinator's resend of every unanswered gradient; lost activations by the agent's
resend of every step in flight; with one message in twenty lost either way, or one in ten
delivered twice, the run learns the same model; losses on a connection that stayed up are
counted and named to the operator."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional

import pytest
import torch

from coordinator.engine import RoundEngine
from simulation.clock import VirtualClock
from simulation.inprocess import InProcessTransport, build_fleet
from simulation.run import run_simulation
from sfl_core.config.run import run_config_from_dict
from sfl_core.data.builtin import load_dataset
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message

FLEET = [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-mid-mid", "count": 1},
         {"profile": "heterosfl-high", "count": 1}]
"""Full-duplex links (the shipped WiFi boards' are half duplex: see the last test)."""


def _cfg(tmp_path: Path, name: str, **over):
    return run_config_from_dict({
        "run": name, "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"}, "fleet": FLEET,
        "rounds": 4, "strategy": "sfl", "split": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.5,
        "local_iters": 10, "output_dir": str(tmp_path / name), **over})


def test_a_window_hides_the_link_and_the_run_learns_as_in_lockstep(tmp_path):
    lockstep, _ = run_simulation(_cfg(tmp_path, "w1", rounds=6))
    piped, _ = run_simulation(_cfg(tmp_path, "w4", rounds=6, window=4))
    assert piped[-1]["elapsed_s"] < 0.7 * lockstep[-1]["elapsed_s"]
    assert piped[-1]["accuracy"] > 0.65 and lockstep[-1]["accuracy"] > 0.65
    assert abs(piped[-1]["accuracy"] - lockstep[-1]["accuracy"]) < 0.1
    for row in piped[-1]["agents"].values():
        assert row["window"] == 4 and row["overlap_s"] > 0
        assert row["time_s"] < row["client_s"] + row["transfer_s"] + row["server_s"] + 1.0   # charged less the overlap
    assert all("window" not in row for row in lockstep[-1]["agents"].values())   # lock-step records nothing new
    # the same bytes move either way: a window changes when, not what
    assert piped[-1]["bytes_up"] == pytest.approx(lockstep[-1]["bytes_up"], rel=0.05)


def test_on_a_wifi_board_a_window_hides_only_its_compute_and_latency(tmp_path):
    """The shipped boards' WiFi is half duplex: the profile says so at registration, and the
    clock lets a window overlap the board's compute and latency with its transfers, never its
    upload with its download."""
    fleet = [{"profile": "jetson-nano", "count": 2}]
    lockstep, _ = run_simulation(_cfg(tmp_path, "h1", fleet=fleet, rounds=2))
    piped, engine = run_simulation(_cfg(tmp_path, "h4", fleet=fleet, rounds=2, window=4))
    assert all(info.profile.half_duplex for info in engine.registry.agents.values())
    rate = engine.registry.agents["sim-000"].profile.link_bytes_per_s
    for row in piped[-1]["agents"].values():
        assert row["window"] == 4 and 0 < row["overlap_s"]
        assert row["time_s"] >= (row["bytes_up"] + row["bytes_down"]) / rate   # every byte end to end
    assert piped[-1]["round_time_s"] > 0.8 * lockstep[-1]["round_time_s"]


def test_auto_plans_the_window_with_the_cut_and_the_batch(tmp_path):
    history, _ = run_simulation(_cfg(tmp_path, "wa", strategy="auto", window="auto", rounds=2))
    plan = history[-1]["auto"]
    assert {a["window"] for a in plan["assign"].values() if "window" in a} <= {2, 4}
    assert any("window" in a for a in plan["assign"].values())     # the link-bound devices pipeline
    assert abs(plan["error"]) < 0.15      # the planner's round as the clock charged it


class OverTheFleet(InProcessTransport):
    """The in-process fleet of ``inner``, its messages passed through a subclass's rules."""

    def __init__(self, inner: InProcessTransport):
        super().__init__(inner.run_id, inner.agents)
        self._inbox = inner._inbox

    def idle(self, *agents: str) -> None:
        """``agents`` say they are idle (a deployed agent's heartbeat: nothing left to compute)."""
        self._inbox.extend(Message("heartbeat", self.run_id, a, {"state": "idle"}, round=1, seq=protocol.next_seq())
                           for a in agents)


def _run(cfg, over=None):
    """The run of ``cfg`` on the digits, its fleet wrapped by ``over`` if given: its history,
    its final model and the transport."""
    data = load_dataset("digits")
    t = build_fleet(cfg, data)
    t = over(t) if over is not None else t
    engine = RoundEngine(cfg, t, VirtualClock(), (data.x_test, data.y_test), input_shape=data.input_shape,
                         num_classes=data.num_classes, out_dir=Path(cfg.output_dir))
    return engine.run(), engine.model.state_dict(), t


class LosesOneGradient(OverTheFleet):
    """The in-process fleet, where one gradient to ``agent`` is lost on the way; the agent, with
    nothing left to compute, then says it is idle (a deployed agent's heartbeat)."""

    def __init__(self, inner: InProcessTransport, agent: str, step: int):
        super().__init__(inner)
        self.agent, self.step = agent, step
        self.lost: Optional[Message] = None
        self.after: list[int] = []
        """The steps of the gradients sent to the agent in that round after the lost one."""

    def send(self, agent_id: str, msg: Message) -> int:
        if agent_id == self.agent and msg.type == "gradients" and msg.round == 1:
            if msg.step == self.step and self.lost is None:
                self.lost = msg
                return len(msg.encode())
            if self.lost is not None:
                self.after.append(msg.step)
        return super().send(agent_id, msg)

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is None and self.lost is not None and self.step not in self.after:
            self.idle(self.agent)
        return msg


def test_a_lost_gradient_is_resent_with_every_unanswered_one_and_the_round_completes(tmp_path):
    history, _, t = _run(_cfg(tmp_path, "wl", window=3, rounds=2, local_iters=6),
                         lambda fleet: LosesOneGradient(fleet, "sim-001", step=2))
    assert t.lost is not None
    # steps 3 and 4 had come in ahead, so gradients 3 and 4 went out after the lost 2; the agent,
    # holding them, fell idle: all three went again, the lost one first, and the round went on
    assert t.after[:5] == [3, 4, 2, 3, 4]
    assert history[1]["completed"] == ["sim-000", "sim-001", "sim-002"]
    assert history[2]["completed"] == ["sim-000", "sim-001", "sim-002"]


class LosesOneActivations(OverTheFleet):
    """The in-process fleet, where ``agent``'s activations of one step are lost on the way (its
    later steps in flight arrive); the agent, waiting for that step's gradients, then says it is
    idle until the step comes in."""

    def __init__(self, inner: InProcessTransport, agent: str, step: int):
        super().__init__(inner)
        self.agent, self.step = agent, step
        self.lost: Optional[Message] = None
        self.steps: list[int] = []
        """The steps of the agent's activations of round 1 that reached the coordinator."""

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is not None and msg.sender == self.agent and msg.type == "activations" and msg.round == 1:
            if msg.step == self.step and self.lost is None:
                self.lost = msg
                return self.poll(timeout)
            self.steps.append(msg.step)
        if msg is None and self.lost is not None and self.step not in self.steps:
            self.idle(self.agent)
        return msg


def test_lost_activations_come_again_after_the_later_steps_and_the_round_completes(tmp_path):
    """Steps 3 and 4 reach the coordinator before step 2 was lost for good: the agent's resends
    (new seqs) are taken, not refused as replays of seqs older than 3's and 4's, and the agent
    stays in the round rather than being dropped once it falls silent."""
    history, _, t = _run(_cfg(tmp_path, "la", window=3, rounds=2, local_iters=6),
                         lambda fleet: LosesOneActivations(fleet, "sim-001", step=2))
    assert t.lost is not None
    assert t.steps[:5] == [0, 1, 3, 4, 2]      # the lost step again, after the ones ahead of it
    assert history[1]["completed"] == ["sim-000", "sim-001", "sim-002"]
    assert "replayed" not in history[1].get("rejected", {}), history[1]["rejected"]
    assert history[2]["completed"] == ["sim-000", "sim-001", "sim-002"]


class LossyLinks(OverTheFleet):
    """The in-process fleet over links that lose each training message, either way, with
    probability ``p`` (from round 1; seeded), and agents that say they are idle whenever the
    coordinator finds nothing to read (a deployed agent's heartbeat)."""

    TRAINING = frozenset({"assign", "activations", "gradients", "weights", "logits", "logit_grads"})

    def __init__(self, inner: InProcessTransport, p: float, seed: int):
        super().__init__(inner)
        self.p, self.rng = p, random.Random(seed)
        self.lost = {"up": 0, "down": 0}

    def _loses(self, msg: Message) -> bool:
        return msg.type in self.TRAINING and msg.round >= 1 and self.rng.random() < self.p

    def send(self, agent_id: str, msg: Message) -> int:
        if self._loses(msg):
            self.lost["down"] += 1
            return len(msg.encode())
        return super().send(agent_id, msg)

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        while msg is not None and self._loses(msg):
            self.lost["up"] += 1
            msg = super().poll(timeout)
        if msg is None:
            self.idle(*self.agents)
        return msg


SETTINGS = {"window 1": {}, "window 2": {"window": 2}, "window 4": {"window": 4},
            "auto, window auto": {"strategy": "auto", "window": "auto"},
            "labels withheld, window 2": {"privacy": {"withhold_labels": True}, "window": 2}}
"""Runs the faults below must not change: lock-step, steps in flight, the planner's windows, and
an exchange of logits (labels withheld keep lock-step whatever the window)."""


def _same_run_despite(tmp_path, setting: dict, over) -> tuple[list[dict], OverTheFleet]:
    """The run of ``setting`` with its fleet wrapped by ``over``: every round completes with every
    agent, and the model comes out identical to the undisturbed run's (each step applied exactly
    once, in order)."""
    _, clean, _ = _run(_cfg(tmp_path, "clean", rounds=2, local_iters=8, **setting))
    history, model, t = _run(_cfg(tmp_path, "disturbed", rounds=2, local_iters=8, **setting), over)
    for r in history[1:]:
        assert r["completed"] == ["sim-000", "sim-001", "sim-002"], r["completed"]
    assert all(torch.equal(model[k], clean[k]) for k in clean)
    return history, t


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_messages_lost_both_ways_change_nothing_the_run_learns(tmp_path, setting):
    """Training messages lost either way, one in twenty. With steps in flight, before the agent
    re-sent them under new seqs, most agents were dropped from their rounds."""
    history, links = _same_run_despite(tmp_path, setting, lambda fleet: LossyLinks(fleet, 0.05, seed=1))
    assert links.lost["up"] and links.lost["down"], links.lost
    assert not any("replayed" in r.get("rejected", {}) for r in history[1:])   # every resend was taken


class LossyBroker(LossyLinks):
    """:class:`LossyLinks` as a broker loses messages: with a reason to give the operator
    (:meth:`loss_hint`), and, with ``outage``, a connection that drops whenever a message is lost
    (then the outage is the reason, already in the log)."""

    def __init__(self, inner: InProcessTransport, p: float, seed: int, outage: bool = False):
        super().__init__(inner, p, seed)
        self.outage = outage

    def outages(self) -> int:
        return sum(self.lost.values()) if self.outage else 0

    def loss_hint(self, in_flight: int) -> str:
        return f"the broker's queue ({in_flight} in flight)"


def test_messages_lost_on_a_connection_that_stayed_up_are_named_once_with_the_brokers_reason(tmp_path, caplog):
    """Each round counts the times an agent waited for a lost message and was sent it again
    (``resent``). The first round with such losses logs one WARNING with what the transport
    says drops them, and the most the round's agents kept in flight (3 agents x window 2);
    later rounds say it at INFO. Where the connection itself dropped, the outage explains the
    loss and nothing more is said."""
    cfg = _cfg(tmp_path, "lb", window=2, rounds=3, local_iters=8)
    with caplog.at_level(logging.INFO, logger="sfl.coord"):
        history, _, t = _run(cfg, lambda fleet: LossyBroker(fleet, 0.05, seed=1))
    lossy = [r["round"] for r in history if r.get("resent")]
    assert len(lossy) >= 2, [r.get("resent") for r in history]
    told = [rec for rec in caplog.records if "lost on the way" in rec.getMessage()]
    assert [rec.levelno for rec in told] == [logging.WARNING] + [logging.INFO] * (len(lossy) - 1)
    assert told[0].getMessage().startswith(f"round {lossy[0]}: agents whose connection stayed up waited "
                                           f"{history[lossy[0]]['resent']} time(s)")
    assert told[0].getMessage().endswith("5 s idle before they went again: the broker's queue (6 in flight)")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sfl.coord"):
        history, _, t = _run(_cfg(tmp_path, "lo", window=2, rounds=3, local_iters=8),
                             lambda fleet: LossyBroker(fleet, 0.05, seed=1, outage=True))
    assert any(r.get("resent") for r in history)
    assert "lost on the way" not in caplog.text


class Echoes(OverTheFleet):
    """The in-process fleet, where each training message, either way, comes twice with
    probability ``p``, the copy a few messages later (MQTT's at-least-once delivery, a copy
    re-sent after a reconnect overtaken by newer messages)."""

    def __init__(self, inner: InProcessTransport, p: float, seed: int):
        super().__init__(inner)
        self.p, self.rng = p, random.Random(seed)
        self.later: list[list] = []   # [messages to go by first, destination (None: the coordinator), message]
        self.copies = 0

    def _echo(self, to: Optional[str], msg: Message) -> None:
        if msg.type in LossyLinks.TRAINING and msg.round >= 1 and self.rng.random() < self.p:
            self.copies += 1
            self.later.append([self.rng.randint(1, 6), to, msg])

    def _due(self) -> None:
        for item in self.later:
            item[0] -= 1
        for _, to, msg in [item for item in self.later if item[0] <= 0]:
            super().send(to, msg) if to is not None else self._inbox.append(msg)
        self.later = [item for item in self.later if item[0] > 0]

    def send(self, agent_id: str, msg: Message) -> int:
        self._echo(agent_id, msg)
        return super().send(agent_id, msg)

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is not None:
            self._echo(None, msg)
        self._due()
        if msg is None:
            self.idle(*self.agents)
        return msg


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_messages_that_come_twice_and_late_change_nothing_the_run_learns(tmp_path, setting):
    """One training message in ten, either way, delivered again a few messages later: a copy
    behind newer messages is refused as a replay or a duplicate, never applied."""
    _, echoes = _same_run_despite(tmp_path, setting, lambda fleet: Echoes(fleet, 0.1, seed=1))
    assert echoes.copies, "nothing was delivered twice"


def test_sfl_coord_plans_row_with_a_window_matches_the_simulated_run(tmp_path):
    """``sfl-coord plan`` prices the window as the virtual clock charges it: SFL's row with
    ``window: 4`` against a simulated run of it, and each agent's planned window."""
    from sfl_core.fleet import fleet_of
    from sfl_core.methods.preview import DRAWS, preview
    from sfl_core.model.accounting import model_costs
    from sfl_core.model.zoo import build_model

    cfg = _cfg(tmp_path, "wp", window=4, rounds=DRAWS, local_iters=4)
    history, engine = run_simulation(cfg, device="cpu")
    measured = sum(h["round_time_s"] for h in history[1:]) / DRAWS
    model = build_model(cfg.model, engine.input_shape, 10)
    costs = model_costs(cfg.model, engine.input_shape, 10)
    counts = [engine.registry.agents[a].label_counts for a in sorted(engine.registry.agents)]
    rows = {r.method: r for r in preview(cfg, model, costs, fleet_of(cfg, counts))}
    assert rows["SFL"].round_s == pytest.approx(measured, rel=0.15), (rows["SFL"].round_s, measured)
    assert {x.window for x in rows["SFL"].agents.values()} == {4}
    lockstep = {r.method: r for r in preview(_cfg(tmp_path, "wp1", rounds=DRAWS, local_iters=4), model, costs,
                                             fleet_of(cfg, counts))}
    assert rows["SFL"].round_s < 0.8 * lockstep["SFL"].round_s


def test_a_sequential_server_copy_with_steps_in_flight_keeps_learning(tmp_path):
    """The demo fleet with windows of 2 and every device cut at 1 (`strategy: auto` makes the
    server copy sequential and gives the slowest device 2 rows a step): its turns at the round's
    full rate made the copy diverge in this seed's round 9 (accuracy 94 % to 10 %, never back).
    Each turn now steps at most at its device's own rate."""
    from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_to_dict
    demo = run_config_to_dict(load_run_config(default_profiles_dir() / "runs" / "demo.yaml"))
    cfg = run_config_from_dict({**demo, "window": 2, "auto": {**demo.get("auto", {}), "candidates": [1]},
                                "rounds": 16, "seed": 0, "output_dir": str(tmp_path / "seq")})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the bench's setting: this seed's trajectory is the one measured
    try:
        history, _ = run_simulation(cfg, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert history[-1]["learning"]["server"]["server_mode"] == "sequential"
    assert min(a["batch_size"] for r in history[1:] for a in r["agents"].values()) < cfg.batch_size
    assert all(r["accuracy"] > 0.7 for r in history[5:]), [r["accuracy"] for r in history]
