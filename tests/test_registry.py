"""Registry rules that the round engine's waiting and selection depend on."""

import json

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
    resumed.load_totals(json.loads(first.to_json_text()))
    assert resumed.online() == []
    resumed.set_online("a0", True)            # status{online: true} on connect
    assert resumed.online() == []
    _register(resumed, "a0", seq=7)
    assert [a.agent_id for a in resumed.online()] == ["a0"] and resumed.agents["a0"].rounds == 4
    resumed.set_online("a0", False)
    assert resumed.online() == []


def test_the_checkpoint_text_follows_every_change_while_reusing_unchanged_entries():
    """Entries are encoded again only when a saved value changed, compared with a copy: a total
    incremented, a list changed in place and a new profile all show in the next text."""
    from coordinator.registry import _SAVED_FIELDS

    reg = Registry(num_classes=2)
    for a in ("a0", "a1"):
        _register(reg, a)

    def fresh() -> dict:   # every entry encoded anew
        return {a: {**{k: getattr(i, k) for k in _SAVED_FIELDS}, "profile": i.profile.to_dict()}
                for a, i in reg.agents.items()}

    assert json.loads(reg.to_json_text()) == fresh()
    untouched = reg._texts["a1"][2]
    reg.agents["a0"].rounds += 1
    reg.agents["a0"].label_counts[0] = 9          # in place
    assert json.loads(reg.to_json_text()) == fresh()
    assert json.loads(reg.to_json_text())["a0"]["label_counts"] == [9, 1] and reg._texts["a1"][2] is untouched
    _register(reg, "a1", seq=2)                   # re-registration: a new profile object
    assert json.loads(reg.to_json_text()) == fresh()
    del reg.agents["a0"]
    assert list(json.loads(reg.to_json_text())) == ["a1"]


def test_a_checkpoint_holds_the_encoded_registry_beside_the_state(tmp_path):
    import torch

    from coordinator import state as ckpt

    reg = Registry(num_classes=2)
    _register(reg, "a0")
    ckpt.save(tmp_path, {"w": torch.zeros(2)}, {"round": 3, "model": "m"}, encoded={"registry": reg.to_json_text()})
    tensors, st = ckpt.load(tmp_path)
    assert st["round"] == 3 and st["registry"] == json.loads(reg.to_json_text()) and torch.equal(tensors["w"], torch.zeros(2))
    assert json.loads((tmp_path / ckpt.STATE_FILE).read_text()) == st
