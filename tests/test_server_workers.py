"""Server training shared by several processes (``sfl-coord serve --server-workers N``).

Two gloo processes on the CPU must train the model one process trains: first the server
step alone (ranks holding different agents' rows, mixed cuts, one all-reduce per step),
then a whole run over Mosquitto with real agent processes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coordinator.server_trainer import ServerTrainer
from coordinator.server_workers import GradReducer, ServerShards, shard_agents, workers_hold_validation
from sfl_core.model.zoo import build_model
from sfl_core.transport.mqtt_link import MqttLink
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol

from helpers import finish, logs, metrics, start_agents, start_coord, write_config

_AGENTS = {"a": 1, "b": 2, "c": 1, "d": 2}    # agent -> split (mixed cuts, one merged group)
_BATCH = {"a": 4, "b": 6, "c": 5, "d": 3}


def _batches(step: int) -> dict:
    model = build_model("small_cnn", (1, 8, 8), 10)
    gen = torch.Generator().manual_seed(step)
    out = {}
    for a, split in _AGENTS.items():
        x = torch.randn(_BATCH[a], 1, 8, 8, generator=gen)
        with torch.no_grad():
            h = model.client(split)(x)
        out[a] = (torch.randn(h.shape, generator=gen), torch.randint(0, 10, (_BATCH[a],), generator=gen))
    return out


def _train(trainer: ServerTrainer, mine: list[str], steps: int = 3) -> tuple[dict, list[float]]:
    trainer.begin_round([sorted(_AGENTS)], _AGENTS)
    grads, losses = {}, []
    for k in range(steps):
        batches = {a: b for a, b in _batches(k).items() if a in mine}
        g, loss = trainer.step(batches)
        grads.update({f"{a}{k}": v for a, v in g.items()})
        losses.append(loss)
    return grads, losses


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    shards = ServerShards(rank, world, torch.device("cpu"))
    trainer = ServerTrainer(model, lr=0.1, momentum=0.5, reducer=GradReducer(shards))
    owners = shard_agents(_AGENTS, world)
    grads, losses = _train(trainer, [a for a, r in owners.items() if r == rank])
    state = trainer.member_state("a", 1)
    torch.save({"grads": grads, "losses": losses, "state": state}, f"{out}/rank{rank}.pt")
    shards.close()


def test_shard_agents_is_round_robin_over_sorted_ids():
    assert shard_agents(["c", "a", "b", "d", "e"], 2) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert set(shard_agents(["x"], 3).values()) == {0}


def test_a_worker_holds_the_validation_set_unless_only_the_leader_knows_its_scaling():
    """A worker screens its own agents' rows against the server's held-out samples (robust:) and
    scores a block of them, except where only the leader knows how the agents standardise
    their inputs."""
    assert workers_hold_validation(SimpleNamespace(task=None))
    assert workers_hold_validation(SimpleNamespace(task=SimpleNamespace(normalize="none")))
    assert workers_hold_validation(SimpleNamespace(task=SimpleNamespace(normalize=((0.5,), (0.2,)))))
    assert not workers_hold_validation(SimpleNamespace(task=SimpleNamespace(normalize="federated")))


def test_blocks_of_the_validation_set_cover_it_once_in_rank_order():
    from coordinator.shard_scoring import block

    for total in (0, 1, 2, 37, 256):
        for world in (1, 2, 3, 4):
            parts = [block(total, r, world) for r in range(world)]
            assert [i for p in parts for i in range(total)[p]] == list(range(total))
            assert max(len(range(total)[p]) for p in parts) - min(len(range(total)[p]) for p in parts) <= 1


_SCORED = 37   # samples: blocks of 18 and 19


def _scoring_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(_SCORED, 1, 8, 8, generator=gen), torch.randint(0, 10, (_SCORED,), generator=gen)


def _scoring_rank(rank: int, world: int, init: str, out: str) -> None:
    """The leader scores its model twice (at a cut, keeping the draw's rows, and whole) with a
    worker whose own model differs: the worker must score the leader's."""
    from coordinator import shard_scoring
    from coordinator.validation import ValidationSet, screen_draw

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shards = ServerShards(rank, world, torch.device("cpu"))
    torch.manual_seed(rank)   # the worker's model is not the leader's
    model = build_model("small_cnn", (1, 8, 8), 10)
    held = ValidationSet(*_scoring_data())
    if rank == 0:
        at_cut = shard_scoring.lead(shards, held, model, 1, screen_draw(_SCORED, 20), torch.device("cpu"), 8)
        whole = shard_scoring.lead(shards, held, model, None, None, torch.device("cpu"), 8)
        torch.save({"at_cut": at_cut, "whole": whole}, f"{out}/scored.pt")
        shards.broadcast(None)
    else:
        own = {k: v.clone() for k, v in model.state_dict().items()}
        while (doc := shards.broadcast()) is not None:
            shard_scoring.follow(shards, held, model, doc["score"], torch.device("cpu"), 8)
        for k, v in model.state_dict().items():   # its own model stays the round's
            assert torch.equal(v, own[k]), k
    shards.close()


def _mismatched_rank(rank: int, world: int, init: str, out: str) -> None:
    """A worker holding fewer samples than the leader."""
    from coordinator import shard_scoring
    from coordinator.validation import ValidationSet

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shards = ServerShards(rank, world, torch.device("cpu"))
    model = build_model("small_cnn", (1, 8, 8), 10)
    x, y = _scoring_data()
    held = ValidationSet(x, y, limit=None if rank == 0 else 30)
    if rank == 0:
        try:
            shard_scoring.lead(shards, held, model, None, None, torch.device("cpu"), 8)
        except RuntimeError as exc:
            with open(f"{out}/refused.txt", "w") as f:
                f.write(str(exc))
        shards.broadcast(None)
    else:
        while (doc := shards.broadcast()) is not None:
            shard_scoring.follow(shards, held, model, doc["score"], torch.device("cpu"), 8)
    shards.close()


def test_a_worker_holding_another_set_than_the_leaders_stops_the_score_with_one_line(tmp_path):
    mp.start_processes(_mismatched_rank, args=(2, f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    assert (tmp_path / "refused.txt").read_text() == (
        "the server workers scored blocks of [18, 15] samples where the leader's validation set of 37 makes "
        "[18, 19]: every rank must hold the same set")


def test_two_gloo_ranks_score_the_leaders_model_as_one_process_does(tmp_path):
    """Each rank scores a block of the set: the leader gets the one-process accuracy, the same
    mean loss to float rounding, and the client portion's rows of the screens' draw in the
    draw's order (samples of both blocks), as scoring in one process gives them."""
    from coordinator.validation import ValidationSet, screen_draw

    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    held = ValidationSet(*_scoring_data())
    draw = screen_draw(_SCORED, 20)
    assert (draw < _SCORED // 2).any() and (draw >= _SCORED // 2).any()
    accuracy, loss, rows = held.evaluate_at_cut(model, 1, draw, torch.device("cpu"), 8)
    whole = held.evaluate(model, torch.device("cpu"), 8)
    mp.start_processes(_scoring_rank, args=(2, f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(tmp_path / "scored.pt", weights_only=True)
    assert got["at_cut"][0] == accuracy and got["at_cut"][1] == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(got["at_cut"][2], rows, rtol=1e-6, atol=1e-7)
    assert got["whole"][0] == whole[0] and got["whole"][1] == pytest.approx(whole[1], rel=1e-6)
    assert got["whole"][2] is None


def test_two_gloo_ranks_train_the_server_model_one_process_trains(tmp_path):
    """Ranks holding {a, c} and {b, d}: same server weights, same per-agent gradients and the
    same merged loss as one trainer holding all four, to float tolerance."""
    torch.manual_seed(0)
    single = ServerTrainer(build_model("small_cnn", (1, 8, 8), 10), lr=0.1, momentum=0.5)
    grads, losses = _train(single, list(_AGENTS))
    expected = single.member_state("a", 1)
    init = f"file://{tmp_path / 'pg'}"
    mp.start_processes(_rank, args=(2, init, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for part in parts:
        assert part["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(part["state"][name], value, rtol=1e-5, atol=1e-6)
    shared = {**parts[0]["grads"], **parts[1]["grads"]}
    assert sorted(shared) == sorted(grads)
    for key, g in grads.items():
        torch.testing.assert_close(shared[key], g, rtol=1e-5, atol=1e-6)


def _screening_rank(rank: int, world: int, init: str, out: str) -> None:
    """Rank 1 screens its four agents' rows (one sends activations 100x the others'); rank 0, the
    leader, holds no rows, hears of it at the round's end and aggregates without that agent."""
    import json

    from coordinator import shard_round
    from coordinator.option_host import OptionHost
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.options.robust.option import Robust

    class Host(OptionHost):
        def __init__(self, robust):
            self.options, self.lines = [robust], []
            self.registry = SimpleNamespace(agents={})   # nobody registered: the weight cap's median is the round's

        def log(self, text, *, warning=False):
            self.lines.append(text)

        def reference_rows(self, split, width):
            return None

        def quarantine(self, agent_id, why):
            self.lines.append(f"quarantined {agent_id}")

    class Transport:
        not_mine = frozenset({"w0", "w1", "w2", "liar"})

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shards = ServerShards(rank, world, torch.device("cpu"))
    cfg = run_config_from_dict({"model": "small_cnn", "min_agents": 2})
    host = Host(Robust(cfg, build_model("small_cnn", (1, 8, 8), 10)))
    ids = ["w0", "w1", "w2", "liar"]
    assignments = {a: SimpleNamespace(mode="split", split=1, width=0, batch_size=4, tau=2, window=1, lr=0.1)
                   for a in ids}   # what the screens read
    if rank == 1:
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            rows = {a: torch.randn(4, 8, generator=gen) * (100.0 if a == "liar" else 1.0) for a in ids}
            assert host.screen_rows(3, step, {a: SimpleNamespace(assignment=assignments[a]) for a in ids},
                                    {a: (x, None) for a, x in rows.items()}) == {"liar"}
        shards.gather(shard_round.report({}, host.worker_findings(3)))
    else:
        host.merge_worker_findings(3, shard_round.merge_counters(shards, Transport(), {}, []))
        start = {"w": torch.zeros(3)}
        clients = {a: {"w": torch.full((3,), 0.1 * (i + 1))} for i, a in enumerate(ids)}
        kept, weights = host.options[0].screen(host, 3, start, clients, {a: 1.0 for a in ids}, assignments, {})
        with open(f"{out}/leader.json", "w") as f:
            json.dump({"kept": sorted(kept), "weights": sorted(weights), "lines": host.lines,
                       "metrics": host.options[0].round_metrics()}, f)
    shards.close()


def test_a_workers_screened_agent_is_left_out_of_the_leaders_average_and_named(tmp_path):
    """The server portion's screen runs where the rows are, on each server worker; the leader's
    aggregation hears of the agents it left out (their update out, named in the leader's log and
    metrics, counted towards quarantine), through the round's end report over the ranks."""
    import json

    mp.start_processes(_screening_rank, args=(2, f"file://{tmp_path / 'pg'}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    leader = json.loads((tmp_path / "leader.json").read_text())
    assert leader["kept"] == leader["weights"] == ["w0", "w1", "w2"]
    assert leader["metrics"]["rows_left_out"] == {"liar": 2}
    assert leader["metrics"]["activation_scale"]["liar"] > 20
    assert any(line.startswith("robust: round 3: a server worker left the rows of liar out of 2 of its steps")
               for line in leader["lines"]), leader["lines"]


def test_a_malformed_worker_finding_is_named_and_ignored():
    from coordinator.option_host import OptionHost
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.options.robust.option import Robust

    class Host(OptionHost):
        def __init__(self, robust):
            self.options, self.lines = [robust], []

        def log(self, text, *, warning=False):
            self.lines.append(text)

    robust = Robust(run_config_from_dict({"model": "small_cnn", "min_agents": 2}), build_model("small_cnn", (1, 8, 8), 10))
    host = Host(robust)
    host.merge_worker_findings(2, [{"robust": {"rows": {"a": [0, 5.0], "b": ["x", 1], "c": [1, float("nan")],
                                                          "d": [2, 9.0]}}}, {"robust": "junk"}, "junk"])
    assert robust.rows == {"d": (2, 9.0)}
    assert sum("malformed" in line for line in host.lines) == 3


def test_a_worker_takes_only_training_messages_on_its_own_topic_and_the_leader_none_beneath_an_agents():
    """An agent's topic's subtopics are for the server worker its assignment names, and only for
    its activations (or logit gradients): anything else there is named and dropped."""
    from coordinator.mqtt_transport import MqttTransport
    from sfl_core.wire.protocol import Message
    t = wire.encode_tensor(torch.randn(2, 4), "fp32", 1)
    acts = Message("activations", "r", "a0", {"x": t, "y": t, "compute_s": 0.1}, 1, 0, 10).encode()
    weights = Message("weights", "r", "a0", {"weights": {"w": t}, "num_samples": 3, "compute_s": 0.2,
                                            "loss": 1.0}, 1, 0, 11).encode()
    worker, leader = MqttTransport("mqtt://127.0.0.1:1", "r", worker=1), MqttTransport("mqtt://127.0.0.1:1", "r")
    try:                        # never connected: the handler is driven directly
        worker._on_message("sfl/r/up/a0/w1", acts)
        assert worker.poll(0).type == "activations"
        for transport, topic, payload in [(worker, "sfl/r/up/a0/w1", weights), (worker, "sfl/r/up/a0/w2", acts),
                                          (leader, "sfl/r/up/a0/w1", acts), (leader, "sfl/r/up/a0/x", acts)]:
            before = transport.rejections.counts().get("malformed", 0)
            transport._on_message(topic, payload)
            assert transport.poll(0) is None and transport.rejections.counts()["malformed"] == before + 1, topic
    finally:
        worker.link.close()
        leader.link.close()


def test_a_worker_that_never_got_an_agents_rows_names_the_topic_the_broker_must_let_it_use(tmp_path, caplog):
    """An ACL written before rows went beneath an agent's topic lets the broker drop them
    silently: the worker that drops an agent it heard from but got no row of says which topic
    the agent must be allowed."""
    from coordinator.registry import Registry
    from coordinator.session import FleetSession, RoundAgent
    from coordinator.transport import LocalTransport
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.wire.assignment import Assignment
    cfg = run_config_from_dict({"run": "r", "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": 2}],
                                "output_dir": str(tmp_path / "out")})
    a = Assignment(model="small_cnn", mode="sfl", split=2, width=0, batch_size=8, lr=0.1, momentum=0.0, tau=3,
                   codec="fp32", zstd_level=1, activation_shape=(32, 4, 4), server_worker=1)
    for follower in (True, False):
        session = FleetSession(cfg, LocalTransport(), Registry(10), virtual=False, now=lambda: 0.0,
                               on_event=lambda *x: None, on_drop=lambda x: None, follower=follower)
        agents = {"a1": RoundAgent("a1", a, last_heard=5.0, last_sent_at=0.0),   # its heartbeats came, no row
                  "a2": RoundAgent("a2", a, last_heard=5.0, last_sent_at=0.0, bytes_up=900),   # rows came
                  "a3": RoundAgent("a3", a, last_heard=0.0, last_sent_at=0.0)}   # nothing came: gone, not barred
        caplog.clear()
        for agent in ("a1", "a2", "a3"):
            session.drop(agents, agent, "silent for 60 s")
        hints = [r.getMessage() for r in caplog.records if "sfl/r/up/" in r.getMessage()]
        assert hints == (["dropping a1 from the round: silent for 60 s; none of its activations reached this "
                          "server worker: the broker must let it publish on sfl/r/up/a1/+ (the ACL of "
                          "sfl-coord broker-config has that rule; docs/brokers.md)"] if follower else []), hints


class _TrainingTopics:
    """A broker client that notes on which topics each agent's activations travel."""

    def __init__(self, url: str, run: str):
        self.run, self.topics = run, {}
        self.reassembler = wire.Reassembler()
        self.link = MqttLink(url, "spy", self._on_message,
                             subscriptions=[f"sfl/{run}/up/+", f"sfl/{run}/up/+/+"])
        self.link.connect(timeout=10)

    def _on_message(self, topic: str, payload: bytes) -> None:
        whole = self.reassembler.feed(topic, payload) if payload else None
        if whole is not None:
            msg = protocol.decode(whole, run=self.run)
            if msg.type == "activations":
                self.topics.setdefault(msg.sender, set()).add(topic)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [{}, {"server_mode": "per_agent", "drift": "scaffold"}],
                         ids=["merged", "per-agent-scaffold"])
def test_serve_with_two_server_workers_trains_the_one_worker_model(mosquitto, tmp_path, extra):
    """`serve --server-workers 2` with three agent processes over Mosquitto: every round
    completes with every agent, per-agent bytes include what the second worker counted, and
    the model equals the single-process run's (the simulation of the same config, which
    test_integration shows equal to `serve` with one process) to float tolerance. With one
    server copy per agent and SCAFFOLD, every rank steps every copy with the leader's
    corrections."""
    config = write_config(tmp_path, "sw", rounds=2, **extra)
    seen = _TrainingTopics(mosquitto.url, "sw")
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url, "--server-workers", "2", "--device", "cpu")
    agents = start_agents(mosquitto.url, "sw", tmp_path)
    try:
        assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    finally:
        seen.link.close()
    # the rank-1 agent's activations went to rank 1's topic only, the leader's agents' to theirs:
    # the leader (subscribed to sfl/sw/up/+) never received the rows rank 1 trains
    assert shard_agents(["a0", "a1", "a2"], 2) == {"a0": 0, "a1": 1, "a2": 0}
    assert seen.topics == {"a0": {"sfl/sw/up/a0"}, "a1": {"sfl/sw/up/a1/w1"}, "a2": {"sfl/sw/up/a2"}}, seen.topics
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2]
    for r in m[1:]:
        assert sorted(r["completed"]) == ["a0", "a1", "a2"]
        for a in r["agents"].values():   # 10 steps of activations, not only the weights
            assert a["bytes_up"] > 10 * 16 * 32 * 4 * 4 * 4 * 0.3 and a["server_s"] > 0
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config
    from coordinator import state as ckpt
    cfg = dataclasses.replace(load_run_config(config), output_dir=str(tmp_path / "sim"))
    history, engine = run_simulation(cfg, device="cpu")
    for got, want in zip(m[1:], history[1:]):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-3)
        assert got["accuracy"] == pytest.approx(want["accuracy"], abs=0.02)
        assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-3)
    # the two ranks shared each score between rounds: round 0's, and each round's
    import re
    blocks = re.findall(r"server worker 1: scored samples (\d+) to (\d+) of the validation set", logs(tmp_path))
    assert len(blocks) == 3 and len(set(blocks)) == 1, logs(tmp_path)
    assert 0 < int(blocks[0][0]) < int(blocks[0][1]), blocks   # the second half of the set
    served, _ = ckpt.load(tmp_path / "out")
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(served[name].float(), value.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_server_worker_stops_the_coordinator_and_resume_finishes(mosquitto, tmp_path):
    """Killing rank 1 mid-run is a coordinator crash: the leader stops with one line naming it,
    the agents wait, and `--resume` (two workers again) completes the run from the checkpoint."""
    config = write_config(tmp_path, "swk", rounds=4, local_iters=20)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url, "--server-workers", "2", "--device", "cpu")
    agents = start_agents(mosquitto.url, "swk", tmp_path)
    procs = [coord, *agents]
    try:
        _kill_a_worker_then_resume(config, coord, agents, mosquitto, tmp_path, procs)
    finally:                          # a failed assertion must not leave agents waiting forever
        for p in procs:
            if p.poll() is None:
                p.kill()


def _kill_a_worker_then_resume(config, coord, agents, mosquitto, tmp_path, procs) -> None:
    import subprocess
    deadline = time.monotonic() + 120
    while not ((tmp_path / "out" / "metrics.jsonl").exists() and len(metrics(tmp_path)) >= 2):
        assert time.monotonic() < deadline and coord.poll() is None, logs(tmp_path)
        time.sleep(0.1)
    (worker,) = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(coord.pid)]).split()]
    os.kill(worker, signal.SIGKILL)
    assert coord.wait(timeout=60) == 1, logs(tmp_path)
    text = (tmp_path / "coord.log").read_text()
    assert "a server worker stopped" in text and "--resume" in text and "Traceback" not in text, text[-3000:]
    done = [r["round"] for r in metrics(tmp_path)]
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url, "--server-workers", "2", "--device", "cpu",
                        "--resume", name="coord-resume")
    procs.append(coord)
    assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3, 4] and len(done) >= 2
    assert all(sorted(r["completed"]) == ["a0", "a1", "a2"] for r in m[done[-1] + 1:]), m


def test_server_workers_refuse_what_they_cannot_share_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from cli.coord import app

    config = write_config(tmp_path, "swr", server_mode="sequential")
    res = CliRunner().invoke(app, ["serve", "-c", str(config), "--broker", "mqtt://127.0.0.1:1",
                                   "--server-workers", "2"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "server_mode: sequential" in res.output and "cannot share" in res.output
    res = CliRunner().invoke(app, ["serve", "-c", str(config), "--server-workers", "2"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "server workers need --broker" in res.output
    assert not (tmp_path / "out").exists()
