"""What an operator relies on, in one process (the same faults with real processes and
Mosquitto are in test_operations.py):

- a round that trained nobody is never recorded or checkpointed as done: it is planned again;
- an agent that announces itself again from the same process (it saw the run described anew
  after a resume) stays in its round; a restarted one (another process) is dropped;
- a flood of invented registrations is bounded (rate, a link probe first, a full registry)
  and never selected; silent agents that never trained are pruned;
- the coordinator signs what steers an agent, and the agent's trust decides what it follows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from coordinator import state as ckpt
from coordinator.engine import RoundFailed
from coordinator.session import FleetSession
from coordinator.transport import LocalTransport
from coordinator.registry import Registry
from sfl_core.wire import signing
from sfl_core.wire import protocol
from sfl_core.config.run import load_profile
from sfl_core.wire.protocol import Message

from test_engine_faults import Recording, _cfg, _engine, _fleet


def _register(cfg, t, agent: str, *, instance: str = "", index: Optional[int] = None) -> Message:
    core = t.agents[agent]
    body = protocol.register_body(index=int(agent[-1]) if index is None else index,
                                  profile=load_profile("s2fl-mid-mid"), measured={},
                                  label_counts=core.data.label_counts(), num_samples=len(core.data), emulate=True,
                                  resume={}, privacy={}, instance=instance)
    return Message("register", cfg.run_id, agent, body, seq=protocol.next_seq())


class Injecting(Recording):
    """Injects a list of messages right after a message matching ``when`` reaches the engine."""

    def __init__(self, inner, when, make):
        super().__init__(inner)
        self.when, self.make, self.fired = when, make, 0

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is not None and self.fired == 0 and self.when(msg):
            self.fired += 1
            for m in reversed(self.make()):
                self._inbox.appendleft(m)
        return msg


def build(cfg) -> Recording:
    return _fleet(cfg)


# ============================================================ defect 2: rounds that trained nobody

def test_a_round_whose_agents_were_all_dropped_is_planned_again_not_recorded(tmp_path):
    """Every agent re-registers from a new process after its round-2 activations: all are
    dropped. The round is not recorded with nobody completing it (today's main wrote
    ``completed: []`` and checkpointed it), the model goes back to the round's start, and the
    round is planned again and trains everyone."""
    cfg = _cfg(tmp_path)
    t = Injecting(build(cfg), lambda m: m.type == "activations" and m.round == 2 and m.step == 1,
                  lambda: [_register(cfg, t, a, instance="restarted") for a in sorted(t.agents)])
    history = _engine(cfg, t).run()
    assert t.fired == 1
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert all(r["completed"] == ["sim-000", "sim-001", "sim-002"] for r in history[1:]), history
    recorded = [m["round"] for m in ckpt.read_metrics(Path(cfg.output_dir))]
    assert recorded == [0, 1, 2, 3]


def test_a_round_nobody_can_train_fails_visibly_with_earlier_rounds_kept(tmp_path):
    """An agent set that is dropped at every attempt of round 2: RoundFailed after five
    plans, round 1 in the checkpoint, nothing recorded for round 2."""
    cfg = _cfg(tmp_path, rounds=3)
    t = build(cfg)
    engine = _engine(cfg, t)
    real = engine._aggregate_and_record

    def everyone_dropped(r, plan, agents, uploads, losses, wall_s):
        return real(r, plan, agents, {} if r == 2 else uploads, losses, wall_s)
    engine._aggregate_and_record = everyone_dropped
    with pytest.raises(RoundFailed, match="round 2 did not count after 5 attempts"):
        engine.run()
    assert ckpt.load(Path(cfg.output_dir))[1]["round"] == 1
    assert [m["round"] for m in ckpt.read_metrics(Path(cfg.output_dir))] == [0, 1]


def test_min_completed_sets_how_many_must_complete(tmp_path):
    cfg = _cfg(tmp_path, min_completed=3)
    engine = _engine(cfg, build(cfg))
    assert engine._needed(3) == 3 and engine._needed(2) == 2
    cfg = _cfg(tmp_path)
    assert _engine(cfg, build(cfg))._needed(3) == 1


# ============================================================ defect 2: re-announcement is not a restart

@pytest.mark.parametrize("same_process", [True, False])
def test_the_same_process_announcing_itself_again_stays_in_its_round(tmp_path, same_process):
    """sim-001 registers again mid-round 2 after its activations. From the process that
    registered before (same instance: it saw a new run description), it stays in the round
    and completes it; from another process (a restart) it is dropped, as before."""
    cfg = _cfg(tmp_path)
    t = Injecting(build(cfg), lambda m: m.sender == "sim-001" and m.type == "activations" and m.round == 2
                  and m.step == 1,
                  lambda: [_register(cfg, t, "sim-001", instance="p1" if same_process else "p2")])
    engine = _engine(cfg, t)
    engine.session.wait_for_agents()
    engine.registry.agents["sim-001"].instance = "p1"   # what its status messages said
    history = engine.run()
    expect = ["sim-000", "sim-001", "sim-002"] if same_process else ["sim-000", "sim-002"]
    assert history[2]["completed"] == expect
    assert history[3]["completed"] == ["sim-000", "sim-001", "sim-002"]


# ============================================================ defect 6: registration floods

class Probed(Recording):
    """The in-process fleet as MQTT sees it: registrations need a link probe first."""

    def __init__(self, inner, fakes: int):
        super().__init__(inner)
        self.probed = {a: None for a in inner.agents}
        self.fakes = fakes
        self.flooded = False

    def poll(self, timeout: float) -> Optional[Message]:
        msg = super().poll(timeout)
        if msg is not None and not self.flooded and msg.type == "weights" and msg.round == 1:
            self.flooded = True
            core = next(iter(self.agents.values()))
            for i in range(self.fakes):
                body = protocol.register_body(index=0, profile=load_profile("s2fl-high-high"), measured={},
                                              label_counts=core.data.label_counts(), num_samples=len(core.data),
                                              emulate=False, resume={}, privacy={})
                fake = f"fake-{i}"
                if i % 2:
                    self.probed[fake] = None   # half of them even probed the link
                self._inbox.append(Message("register", "ef", fake, body, seq=protocol.next_seq()))
        return msg


def test_a_registration_flood_is_bounded_never_selected_and_pruned(tmp_path):
    """300 invented ids register after round 1 (half of them having probed the link). Today's
    main accepted all of them, selected them and kept them in the checkpoint. Now: new ids are
    rate-limited, the unprobed refused, the registry stays within max_registered, none is
    selected, and the never-trained silent ones are pruned from the checkpoint."""
    cfg = _cfg(tmp_path, rounds=3, max_registered=8)
    t = Probed(build(cfg), fakes=300)
    engine = _engine(cfg, t)
    engine.session.wait_for_agents()
    engine.session.virtual = False          # liveness as in a deployment: the fakes never say online
    for info in engine.registry.agents.values():
        info.last_seen = float("inf")
    history = engine.run()
    real = ["sim-000", "sim-001", "sim-002"]
    assert all(r["selected"] == real for r in history[1:]), [r["selected"] for r in history]
    rejected = engine.rejected_totals()
    assert rejected.get("rate_limited", 0) > 250 and rejected.get("unprobed", 0) > 0, rejected
    assert len(engine.registry.agents) <= 8
    saved = json.loads((Path(cfg.output_dir) / ckpt.STATE_FILE).read_text())
    assert sorted(saved["registry"]) == real


def test_a_full_registry_prunes_silent_never_trained_entries_first(tmp_path):
    cfg = _cfg(tmp_path, max_registered=4)

    class T(LocalTransport):
        sent: list = []

        def send(self, a, m):
            self.sent.append((a, m))
            return 0
    reg = Registry(10)
    session = FleetSession(cfg, T(), reg, virtual=False, now=lambda: 0.0, on_event=lambda *a: None,
                           on_drop=lambda a: None)
    core_counts = [1] * 10
    for i in range(6):
        body = protocol.register_body(index=i, profile=load_profile("s2fl-low-low"), measured={},
                                      label_counts=core_counts, num_samples=10, emulate=False, resume={}, privacy={})
        session.dispatch(Message("register", cfg.run_id, f"a{i}", body, seq=protocol.next_seq()), None)
        if i == 0:
            reg.agents["a0"].rounds = 3      # a0 trained: it is never pruned
        reg.agents[f"a{i}"].online = i == 0  # the others fell silent
    assert "a0" in reg.agents and len(reg.agents) <= 4 and "a5" in reg.agents


# ============================================================ defect 5: signatures

def test_signatures_cover_the_whole_envelope_and_trust_pins_one_key(tmp_path):
    coord, forger = signing.Signer.generate(), signing.Signer.generate()
    msg = coord.sign(Message("assign", "r", "coordinator", {"split": 2, "weights": {"w": b"\1" * 10}}, round=3,
                             seq=7))
    decoded = protocol.Message(**{**msg.__dict__})
    assert signing.verify(decoded, coord.public) and not signing.verify(decoded, forger.public)
    for change in ({"round": 4}, {"seq": 8}, {"body": {**msg.body, "split": 3}}):
        assert not signing.verify(Message(**{**msg.__dict__, **change}), coord.public), change
    assert not signing.verify(Message("assign", "r", "coordinator", {"split": 2}), coord.public)  # unsigned

    path = tmp_path / "trust.json"
    assert "no key is trusted" in signing.Trust(trust_file=path).decide("run", coord.public)  # no first use
    trust = signing.Trust(trust_file=path, first_use=True)
    assert trust.decide("run", coord.public) is None                    # pinned on first use, saved
    assert "not the trusted" in trust.decide("run", forger.public)
    assert signing.Trust(trust_file=path).decide("run", forger.public)  # a restart keeps the pin
    assert signing.Trust(explicit=coord.public).decide("other", forger.public)
    assert signing.parse_public(signing.public_text(coord.public), "x") == coord.public
    (tmp_path / "c.pub").write_text(signing.public_text(coord.public) + "\n")
    assert signing.parse_public(str(tmp_path / "c.pub"), "x") == coord.public
    with pytest.raises(signing.TrustError, match="--coordinator-key: expected a coordinator public key"):
        signing.parse_public("nonsense", "--coordinator-key")


def test_a_signed_message_that_names_another_agent_is_not_followed():
    coord = signing.Signer.generate()
    msg = coord.sign(Message("assign", "r", "coordinator", {"split": 2, "to": "a0"}, round=3, seq=7))
    assert signing.verify(msg, coord.public)
    assert signing.misaddressed(msg, "a0") is None
    assert signing.misaddressed(msg, "a1") == "it is addressed to 'a0', not to 'a1'"
    renamed = Message(**{**msg.__dict__, "body": {**msg.body, "to": "a1"}})
    assert not signing.verify(renamed, coord.public)                  # the name is inside the signature
    unnamed = coord.sign(Message("assign", "r", "coordinator", {"split": 2}, round=3, seq=8))
    assert signing.misaddressed(unnamed, "a1") is None                 # an older coordinator names nobody
    # every signed message to one agent may carry the name; nothing an agent sends, and never a non-string
    for mtype in ("assign", "evaluate", "shutdown", *protocol.OPTION_COORD_TYPES):
        assert protocol.OPTIONAL[mtype]["to"] is str, mtype
    assert not any("to" in protocol.OPTIONAL.get(t, {}) for t in protocol.AGENT_TYPES)
    with pytest.raises(protocol.wire.WireError, match="shutdown.to: expected str"):
        protocol.validate_body("shutdown", {"reason": "done", "to": 1})


def test_the_signing_key_is_kept_with_the_run(tmp_path):
    key = tmp_path / "out" / signing.KEY_FILE
    first = signing.Signer.load_or_create(key)
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert signing.Signer.load_or_create(key).public == first.public   # a resume signs with the same key
    assert (tmp_path / "out" / "coordinator.pub").read_text().strip() == signing.public_text(first.public)
    key.write_text("garbage")
    with pytest.raises(signing.TrustError, match="not an unencrypted PEM private key"):
        signing.Signer.load_or_create(key)



def test_two_agents_with_one_index_are_warned_about(tmp_path, caplog):
    cfg = _cfg(tmp_path)

    class T(LocalTransport):
        def send(self, a, m):
            return 0
    reg = Registry(10)
    session = FleetSession(cfg, T(), reg, virtual=False, now=lambda: 0.0, on_event=lambda *a: None,
                           on_drop=lambda a: None)
    for agent in ("pi-1", "pi-2"):
        body = protocol.register_body(index=4, profile=load_profile("s2fl-low-low"), measured={},
                                      label_counts=[1] * 10, num_samples=10, emulate=False, resume={}, privacy={})
        session.dispatch(Message("register", cfg.run_id, agent, body, seq=protocol.next_seq()), None)
    assert "agent pi-2 registered with --index 4, which agent pi-1 also uses" in caplog.text
    assert sorted(reg.agents) == ["pi-1", "pi-2"]                      # a warning, not a refusal
