"""Tests for sfl_core.config.run: shipped profiles/run files load, and bad input fails loudly."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from sfl_core.config import reference as config_reference
from sfl_core.config.run import (
    ConfigError,
    DeviceProfile,
    RunConfig,
    default_profiles_dir,
    list_profiles,
    load_profile,
    load_run_config,
    profile_from_dict,
    run_config_from_dict,
    run_config_to_dict,
)

PROFILES = default_profiles_dir()
RUN_FILES = sorted((PROFILES / "runs").glob("*.yaml"))
DEVICE_FILES = sorted((PROFILES / "devices").glob("*.yaml"))

S2FL_COMPUTE = {"low": 5e9, "mid": 1e10, "high": 2e10}
S2FL_LINK = {"low": 1e6, "mid": 2e6, "high": 5e6}


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def minimal_run(**extra: object) -> dict:
    d = {"run": "t", "fleet": [{"profile": "s2fl-low-low", "count": 2}]}
    d.update(extra)
    return d


# ------------------------------------------------------------------ shipped files


def test_profiles_dir_is_the_repo_one():
    assert PROFILES == Path(__file__).resolve().parent.parent / "profiles"
    assert {"demo.yaml", "sim-100.yaml", "fedavg-demo.yaml", "splitfed-v1-demo.yaml"} <= {
        p.name for p in RUN_FILES}


@pytest.mark.parametrize("path", DEVICE_FILES, ids=lambda p: p.stem)
def test_every_device_profile_loads_by_name_and_path(path: Path):
    by_name = load_profile(path.stem)
    by_path = load_profile(str(path))
    assert by_name == by_path
    assert by_name.name == path.stem
    assert by_name.compute_flops > 0 and by_name.link_bytes_per_s > 0
    assert by_name.source, "every shipped profile must say where its numbers come from"
    # every number line in the file carries a comment saying where it comes from
    for line in path.read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("compute_flops", "link_bytes_per_s", "latency_s", "memory_bytes"):
            assert "#" in line, f"{path.name}: '{key}' has no source comment"


def test_s2fl_table1_classes_are_exact():
    names = set(list_profiles())
    for c, flops in S2FL_COMPUTE.items():
        for lk, rate in S2FL_LINK.items():
            p = load_profile(f"s2fl-{c}-{lk}")
            assert (p.compute_flops, p.link_bytes_per_s, p.downlink_bytes_per_s) == (flops, rate, rate)
    server = load_profile("s2fl-server")
    assert (server.compute_flops, server.link_bytes_per_s) == (5e10, 1e7)
    assert {"jetson-nano", "jetson-tx2", "jetson-xavier-nx", "jetson-agx-xavier", "rpi4"} <= names
    # real boards are ordered as their vendor peaks are
    flops = [load_profile(n).compute_flops for n in
             ("rpi4", "jetson-nano", "jetson-tx2", "jetson-xavier-nx", "jetson-agx-xavier")]
    assert flops == sorted(flops)


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.stem)
def test_every_run_config_loads_and_documents_every_field(path: Path):
    cfg = load_run_config(path)
    assert cfg.run_id == path.stem
    assert cfg.num_agents == len(cfg.agent_profiles()) > 0
    # the reference block is generated (python -m sfl_core.config.reference --write): up to date
    assert path.read_text().startswith(config_reference.render_yaml_header()), \
        f"{path.name}: stale reference block; run python -m sfl_core.config.reference --write"


def test_config_reference_documents_exactly_what_the_loader_accepts():
    documented = [p for p, _ in config_reference.documented()]
    assert len(documented) == len(set(documented))
    assert set(documented) == config_reference.accepted_keys()
    # and every dataclass field has a key (nothing configurable left out of the loader)
    cfg = run_config_from_dict({"fleet": [{"profile": "s2fl-low-low"}]})
    for section, value in [("data", cfg.data), *cfg.sections.items()]:
        for f in dataclasses.fields(value):
            assert f"{section}.{f.name}" in documented
    assert set(run_config_to_dict(cfg)) <= set(documented)
    docs = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert docs.read_text() == config_reference.render_markdown(), \
        "docs/config.md is stale; run python -m sfl_core.config.reference --write"
    # defaults come from the dataclasses, not from the text
    assert "| `mergesfl.min_batch` |" in docs.read_text() and "| `2` |" in docs.read_text()


def test_demo_and_baselines_content():
    demo = load_run_config(PROFILES / "runs" / "demo.yaml")
    assert (demo.model, demo.data.dataset, demo.data.partition, demo.data.alpha) == (
        "small_cnn", "digits", "dirichlet", 0.5)
    assert demo.num_agents == 4 and len(set(demo.agent_profiles())) == 4
    assert demo.rounds <= 10 and demo.batch_size <= 32  # the demo must stay quick on 2 cores
    assert (demo.strategy, demo.server_mode) == ("auto", "auto")   # the defaults, shown by the demo
    fedavg = load_run_config(PROFILES / "runs" / "fedavg-demo.yaml")
    sfv1 = load_run_config(PROFILES / "runs" / "splitfed-v1-demo.yaml")
    assert fedavg.strategy == "fedavg"
    assert (sfv1.strategy, sfv1.server_mode) == ("sfl", "per_agent")
    for other in (fedavg, sfv1):
        assert other.fleet == demo.fleet and other.data == demo.data
        # baselines differ from the demo only in strategy / server mode, so their results compare
        assert (other.rounds, other.local_iters, other.batch_size, other.lr, other.momentum) == (
            demo.rounds, demo.local_iters, demo.batch_size, demo.lr, demo.momentum)


def test_sim100_composition():
    cfg = load_run_config(PROFILES / "runs" / "sim-100.yaml")
    assert cfg.num_agents == 100 and cfg.per_round == 10
    assert (cfg.model, cfg.data.dataset, cfg.data.alpha) == ("resnet8", "fashion-mnist", 0.5)
    counts = {e.profile: e.count for e in cfg.fleet}
    assert set(counts) == {f"s2fl-{c}-{lk}" for c in S2FL_COMPUTE for lk in S2FL_LINK}
    assert max(counts.values()) - min(counts.values()) <= 1
    # the shipped data root is a placeholder the user sets (or overrides with --data)
    assert cfg.data.root is None


# ------------------------------------------------------------------ semantics


def test_agent_profiles_expansion_order_and_defaults():
    cfg = run_config_from_dict({
        "fleet": [{"profile": "jetson-nano", "count": 2}, "rpi4",
                  {"profile": "s2fl-low-low", "count": 3}]})
    assert cfg.agent_profiles() == ["jetson-nano"] * 2 + ["rpi4"] + ["s2fl-low-low"] * 3
    assert cfg.num_agents == 6
    assert cfg.run_id == "demo" and cfg.per_round is None and cfg.min_agents is None
    assert cfg.resolved_output_dir == Path("runs/demo")
    assert dataclasses.replace(cfg, rounds=7).rounds == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rounds = 3  # type: ignore[misc]


def test_numeric_strings_parse(tmp_path: Path):
    p = write(tmp_path, "nums.yaml", """\
        fleet: [{profile: s2fl-low-low, count: "2"}]
        server_flops: 5e9
        lr: 1e-2
        rounds: 1e1
        step_timeout_s: "2_5"
        data: {alpha: 5e-1}
        """)
    cfg = load_run_config(p)
    assert cfg.server_flops == 5e9 and isinstance(cfg.server_flops, float)
    assert cfg.lr == 0.01 and cfg.rounds == 10 and isinstance(cfg.rounds, int)
    assert cfg.step_timeout_s == 25.0 and cfg.data.alpha == 0.5 and cfg.fleet[0].count == 2
    prof = profile_from_dict({"compute_flops": "5e9", "link_bytes_per_s": 1e6}, default_name="x")
    assert prof == DeviceProfile("x", 5e9, 1e6, 1e6)


def test_round_trip_through_dict():
    cfg = load_run_config(PROFILES / "runs" / "sim-100.yaml")
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    prof = load_profile("jetson-tx2")
    assert profile_from_dict(prof.to_dict()) == prof


def test_downlink_defaults_to_uplink_and_can_differ(tmp_path: Path):
    p = write(tmp_path, "asym.yaml", """\
        compute_flops: 1e9
        link_bytes_per_s: 1e5
        downlink_bytes_per_s: 4e5
        """)
    prof = load_profile(str(p))
    assert prof.name == "asym" and prof.downlink_bytes_per_s == 4e5
    assert DeviceProfile("a", 1.0, 2.0).downlink_bytes_per_s == 2.0


def test_fleet_profile_by_relative_path(tmp_path: Path):
    write(tmp_path, "board.yaml", "name: myboard\ncompute_flops: 3e9\nlink_bytes_per_s: 1e6\n")
    run = write(tmp_path, "run.yaml", "fleet: [{profile: board.yaml, count: 2}, ./board.yaml]\n")
    cfg = load_run_config(run)
    assert cfg.num_agents == 3
    assert all(Path(p).is_absolute() for p in cfg.agent_profiles())
    assert load_profile(cfg.agent_profiles()[0]).name == "myboard"


def test_env_var_overrides_profiles_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "devices").mkdir()
    write(tmp_path / "devices", "only.yaml", "compute_flops: 1e9\nlink_bytes_per_s: 1e6\n")
    monkeypatch.setenv("SFL_PROFILES_DIR", str(tmp_path))
    assert default_profiles_dir() == tmp_path
    assert list_profiles() == ["only"]
    assert load_profile("only").compute_flops == 1e9


# ------------------------------------------------------------------ errors


def test_unknown_key_suggests(tmp_path: Path):
    p = write(tmp_path, "typo.yaml", """\
        fleet: [{profile: s2fl-low-low}]
        local_iter: 20
        """)
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    msg = str(e.value)
    assert "typo.yaml" in msg and "'local_iter'" in msg and "did you mean 'local_iters'" in msg


def test_unknown_nested_key_has_full_path(tmp_path: Path):
    p = write(tmp_path, "nested.yaml", """\
        fleet:
          - {profile: s2fl-low-low}
          - {profile: rpi4, cont: 2}
        """)
    with pytest.raises(ConfigError, match=r"nested\.yaml: field 'fleet\[1\]\.cont'.*did you mean 'count'"):
        load_run_config(p)
    with pytest.raises(ConfigError, match=r"field 'data\.partiton'.*did you mean 'partition'"):
        run_config_from_dict(minimal_run(data={"partiton": "iid"}), "x.yaml")


@pytest.mark.parametrize("key,value,expected", [
    ("rounds", "ten", "a positive integer"),
    ("rounds", 0, "a positive integer"),
    ("rounds", 2.5, "a positive integer"),
    ("rounds", True, "a positive integer"),
    ("lr", -0.1, "a positive number"),
    ("lr", [1], "a positive number"),
    ("momentum", 1.0, "a number in [0, 1)"),
    ("strategy", "fedprox", "one of 'sfl', 'fedavg'"),
    ("server_mode", "split", "one of 'auto', 'merged', 'per_agent'"),
    ("codec", "int4", "one of 'fp32', 'fp16'"),
    ("codec", "topk100", "topk<P>"),
    ("zstd_level", 23, "0 (no compression) to 22"),
    ("run", "a/b", "letters, digits"),
    ("server_flops", "nan", "a positive number"),
    ("model", 3, "a model name such as"),
])
def test_wrong_type_or_range(key: str, value: object, expected: str):
    with pytest.raises(ConfigError) as e:
        run_config_from_dict(minimal_run(**{key: value}), "profiles/runs/bad.yaml")
    msg = str(e.value)
    assert msg.startswith(f"profiles/runs/bad.yaml: field '{key}': expected ")
    assert expected in msg and repr(value) in msg


@pytest.mark.parametrize("section,key,value,expected", [
    ("s2fl", "sliding", "yes", "expected true or false, got 'yes'"),
    ("hetero", "bdks", 1, "expected true or false, got 1"),
    ("mergesfl", "select", "on", "expected true or false, got 'on'"),
    ("s2fl", "candidates", [3, 1], "expected strictly increasing split points, got [3, 1]"),
    ("s2fl", "candidates", [], "expected a non-empty list of split points"),
])
def test_section_errors_say_expected_once(section: str, key: str, value: object, expected: str):
    with pytest.raises(ConfigError) as e:
        run_config_from_dict(minimal_run(**{section: {key: value}}), "bad.yaml")
    msg = str(e.value)
    assert f"bad.yaml: field '{section}.{key}': {expected}" in msg, msg
    assert "expected expected" not in msg


def test_fleet_count_error_names_index(tmp_path: Path):
    p = write(tmp_path, "cnt.yaml", "fleet: [{profile: rpi4}, {profile: rpi4, count: -1}]\n")
    with pytest.raises(ConfigError, match=r"cnt\.yaml: field 'fleet\[1\]\.count': expected a positive integer, got -1"):
        load_run_config(p)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="field 'per_round': expected at most 2"):
        run_config_from_dict(minimal_run(per_round=3), "r.yaml")
    with pytest.raises(ConfigError, match="field 'min_agents': expected at most the fleet size 2"):
        run_config_from_dict(minimal_run(min_agents=5), "r.yaml")
    with pytest.raises(ConfigError, match="r.yaml: field 'fleet': expected at least one"):
        run_config_from_dict({"run": "t"}, "r.yaml")
    # agents that bring their own profiles: no fleet, but min_agents
    assert run_config_from_dict({"min_agents": 3}).num_agents == 0


def test_missing_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_run_config(missing)
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_profile(str(missing))


def test_bad_yaml_syntax_reports_line(tmp_path: Path):
    p = write(tmp_path, "broken.yaml", "run: demo\nfleet: [{profile: rpi4}\nrounds: 3\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    msg = str(e.value)
    assert "broken.yaml" in msg and "invalid YAML" in msg and "line 3" in msg


def test_duplicate_key_is_an_error(tmp_path: Path):
    p = write(tmp_path, "dup.yaml", "fleet: [rpi4]\nrounds: 3\nrounds: 4\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: line 3.*duplicate key 'rounds'"):
        load_run_config(p)


def test_top_level_must_be_mapping(tmp_path: Path):
    p = write(tmp_path, "list.yaml", "- rpi4\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level: expected a mapping"):
        load_run_config(p)


def test_unknown_profile_name_in_fleet(tmp_path: Path):
    p = write(tmp_path, "fleet.yaml", "fleet: [{profile: s2fl-low-low}, {profile: jetson-nan0, count: 2}]\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    msg = str(e.value)
    assert "fleet.yaml" in msg and "'fleet[1].profile'" in msg
    assert "did you mean 'jetson-nano'" in msg and "s2fl-high-high" in msg  # lists what exists


def test_unknown_profile_name_direct():
    with pytest.raises(ConfigError, match="unknown device profile.*available: .*rpi4"):
        load_profile("no-such-board")


def test_profile_errors(tmp_path: Path):
    p = write(tmp_path, "dev.yaml", "compute_flops: fast\nlink_bytes_per_s: 1e6\n")
    with pytest.raises(ConfigError, match=r"dev\.yaml: field 'compute_flops': expected a positive number, got 'fast'"):
        load_profile(str(p))
    p = write(tmp_path, "dev2.yaml", "link_bytes_per_s: 1e6\n")
    with pytest.raises(ConfigError, match=r"dev2\.yaml: field 'compute_flops'.*missing"):
        load_profile(str(p))
    p = write(tmp_path, "dev3.yaml", "compute_flop: 1e9\nlink_bytes_per_s: 1e6\n")
    with pytest.raises(ConfigError, match=r"dev3\.yaml: field 'compute_flop'.*did you mean 'compute_flops'"):
        load_profile(str(p))
    # a file found by name must carry that name, or a fleet entry could silently change device
    (tmp_path / "d").mkdir()
    write(tmp_path / "d", "a.yaml", "name: b\ncompute_flops: 1e9\nlink_bytes_per_s: 1e6\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: field 'name': expected 'a'"):
        load_profile("a", [tmp_path / "d"])


def test_defaults_match_dataclass():
    # a run dict with only a fleet gets exactly the documented dataclass defaults
    cfg = run_config_from_dict({"fleet": ["rpi4"]})
    assert dataclasses.replace(cfg, fleet=()) == RunConfig()


def test_hetero_section():
    base = {"fleet": [{"profile": "s2fl-mid-low", "count": 2}], "split": 2, "strategy": "sfl"}
    cfg = run_config_from_dict({**base, "loss": "calibrated", "calibration_tau": 0.5,
                                "hetero": {"width": 16, "groups": 2, "widths": [2, 16], "thresholds": [1e6],
                                           "codecs": ["int8", "fp32"], "bdks": True, "bdks_alpha": 0.5}})
    h = cfg.sections["hetero"]
    assert (h.width, h.widths, h.thresholds, h.codecs, h.bdks, h.bdks_alpha, h.bdks_theta) == (
        16, (2, 16), (1e6,), ("int8", "fp32"), True, 0.5, 0.1)
    assert (cfg.sections["loss"].kind, cfg.sections["loss"].tau) == ("calibrated", 0.5)
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    bad = [
        ({"width": 16, "widths": [2, 4, 16]}, "hetero.widths"),       # one per group
        ({"widths": [2, 16]}, "set hetero.width"),                     # fixed widths need the full width
        ({"width": 8, "widths": [2, 16]}, "hetero.widths"),           # wider than the full width
        ({"width": 16, "widths": [8, 2]}, "non-decreasing"),
        ({"bdks": True}, "hetero.bdks"),
        ({"codecs": ["fp32"]}, "hetero.codecs"),
        ({"codecs": ["fp32", "zip"]}, "hetero.codecs"),
        ({"thresholds": [1e6, 2e6]}, "hetero.thresholds"),
        ({"groups": 3, "thresholds": [2e6, 1e6]}, "hetero.thresholds"),
        ({"groups": 5}, "hetero.groups"),
        ({"width": 0}, "hetero.width"),
    ]
    for hetero, field in bad:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            run_config_from_dict({**base, "hetero": hetero})
    with pytest.raises(ConfigError, match="fixed split"):
        run_config_from_dict({**base, "strategy": "fedavg", "hetero": {"width": 4}})
    with pytest.raises(ConfigError, match="'loss.kind'"):
        run_config_from_dict({**base, "loss": "focal"})
