"""Registry rules that the round engine's waiting and selection depend on."""

from coordinator.registry import Registry
from sfl_core.wire.protocol import Message


def _register(reg: Registry, agent: str, seq: int = 1) -> None:
    body = {"index": 0, "profile": {"name": "p", "compute_flops": 1e9, "link_bytes_per_s": 1e6,
                                    "downlink_bytes_per_s": 1e6, "latency_s": 0.0},
            "measured": {}, "label_counts": [2, 1], "num_samples": 3, "emulate": False, "resume": {}}
    reg.register(Message("register", "r", agent, body, seq=seq))


def test_agent_from_checkpoint_counts_as_online_only_after_registering_again():
    """After --resume an agent's MQTT status can arrive before its registration; counting it then
    would start a round the agent cannot join yet (it is dropped when it registers)."""
    first = Registry(num_classes=2)
    _register(first, "a0")
    first.agents["a0"].rounds = 4
    resumed = Registry(num_classes=2)
    resumed.load_totals(first.to_json())
    assert resumed.online() == []
    resumed.set_online("a0", True)            # status{online: true} on connect
    assert resumed.online() == []
    _register(resumed, "a0", seq=7)
    assert [a.agent_id for a in resumed.online()] == ["a0"] and resumed.agents["a0"].rounds == 4
    resumed.set_online("a0", False)
    assert resumed.online() == []
