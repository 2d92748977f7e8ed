"""``sfl-agent start --config agent.yaml``: the file's settings, flags winning over them.

The pure part (edge_agent.settings) is tested on mappings and files; the glue through the
real ``start`` command with the agent runner replaced by a recorder (no broker needed);
and once as a process, to prove the file is read before anything asks for ``--profile``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import typer
import yaml
from typer.testing import CliRunner

import edge_agent.runner
from cli.agent import app
from sfl_core.wire.signing import Signer, public_text
from edge_agent.settings import OptionSpec, command_option_specs, load_settings_file, settings_from_mapping
from sfl_core.config.run import ConfigError

from conftest import free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "profiles" / "agent.example.yaml"

SPECS = {
    "profile": OptionSpec("str", path="maybe"),
    "broker": OptionSpec("str"),
    "data": OptionSpec("str", path="always"),
    "shard_file": OptionSpec("path", path="always"),
    "index": OptionSpec("int"),
    "slowdown": OptionSpec("float"),
    "emulate": OptionSpec("bool"),
    "tags": OptionSpec("str", multiple=True),
}


def start_specs() -> dict[str, OptionSpec]:
    """The specs the CLI derives from the real ``start`` command."""
    command = typer.main.get_command(app).commands["start"]
    return command_option_specs(command.params, exclude={"config"}, path_options={"data"},
                                maybe_path_options={"profile"})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------ pure checking


def test_values_are_converted_and_nulls_mean_default(tmp_path: Path):
    got = settings_from_mapping({"index": "7", "slowdown": 2, "emulate": True, "broker": "mqtt://h:1",
                                 "profile": None, "tags": ["a", 3]}, SPECS, "a.yaml", tmp_path)
    assert got == {"index": 7, "slowdown": 2.0, "emulate": True, "broker": "mqtt://h:1", "tags": ["a", "3"]}
    assert settings_from_mapping(None, SPECS, "empty.yaml", tmp_path) == {}


def test_unknown_key_is_refused_with_a_did_you_mean(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"a\.yaml: field 'brokr': unknown key; did you mean 'broker'\?"):
        settings_from_mapping({"brokr": "mqtt://h:1"}, SPECS, "a.yaml", tmp_path)
    # the command-line spelling is a different key, and the message says which one is meant
    with pytest.raises(ConfigError, match="did you mean 'shard_file'"):
        settings_from_mapping({"shard-file": "x.json"}, SPECS, "a.yaml", tmp_path)


@pytest.mark.parametrize("key, value, expected", [
    ("index", 3.5, "an integer"),
    ("index", "three", "an integer"),
    ("index", True, "an integer"),
    ("slowdown", "fast", "a number"),
    ("emulate", "yes please", "true or false"),
    ("emulate", 1, "true or false"),
    ("broker", ["mqtt://h:1"], "a non-empty string"),
    ("broker", True, "a non-empty string"),
    ("shard_file", {"a": 1}, "a path"),
    ("tags", "a", "a list"),
])
def test_wrong_types_name_the_file_and_the_key(tmp_path: Path, key: str, value: Any, expected: str):
    with pytest.raises(ConfigError) as err:
        settings_from_mapping({key: value}, SPECS, "etc/agent.yaml", tmp_path)
    assert str(err.value).startswith(f"etc/agent.yaml: field '{key}': expected {expected}")


def test_relative_paths_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # not the file's directory: the result must not depend on it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    f = write(tmp_path / "etc" / "agent.yaml", """\
        data: ../data/fmnist
        shard_file: shards/7.json
        profile: devices/board.yaml
        broker: mqtt://broker:1883
    """)
    got = load_settings_file(f, SPECS)
    etc = (tmp_path / "etc").resolve()
    assert got["data"] == str(etc / "../data/fmnist")
    assert got["shard_file"] == str(etc / "shards/7.json")
    assert got["profile"] == str(etc / "devices/board.yaml")
    assert got["broker"] == "mqtt://broker:1883"   # not a path option: untouched
    # absolute paths, a profile *name* and ~ are not joined to the directory
    f = write(tmp_path / "etc" / "b.yaml", "data: /srv/data\nprofile: jetson-nano\nshard_file: ~/s.json\n")
    got = load_settings_file(f, SPECS)
    assert got == {"data": "/srv/data", "profile": "jetson-nano", "shard_file": str(tmp_path / "home" / "s.json")}


def test_file_errors_are_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="file not found"):
        load_settings_file(tmp_path / "missing.yaml", SPECS)
    with pytest.raises(ConfigError, match="duplicate key 'index'"):
        load_settings_file(write(tmp_path / "dup.yaml", "index: 1\nindex: 2\n"), SPECS)
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_settings_file(write(tmp_path / "list.yaml", "- index\n"), SPECS)


def test_specs_come_from_the_start_command_itself():
    specs = start_specs()
    assert "config" not in specs
    assert {"profile", "broker", "run", "data", "index", "shard_file", "agent_id", "emulate", "seed",
            "withhold_labels", "verbose"} <= set(specs)
    assert specs["index"].kind == "int" and specs["emulate"].kind == "bool" and specs["broker"].kind == "str"
    assert specs["shard_file"] == OptionSpec("path", path="always")
    assert specs["data"].path == "always" and specs["profile"].path == "maybe" and specs["broker"].path is None
    # options added to `start` later are picked up without changes, e.g. TLS files
    for name, spec in specs.items():
        if name.endswith("_file"):
            assert spec.path == "always", name


def test_example_file_documents_every_option_and_loads_uncommented(tmp_path: Path):
    text = EXAMPLE.read_text()
    documented = re.findall(r"^#([a-z_]+):", text, re.M)
    specs = start_specs()
    missing = sorted(set(specs) - set(documented))
    assert not missing, f"add '#KEY: value' lines with a comment to {EXAMPLE} for: {missing}"
    assert not set(documented) - set(specs), "the example documents options 'start' does not have"
    assert load_settings_file(EXAMPLE, specs) == {}   # as shipped, everything is commented out
    uncommented = write(tmp_path / "agent.yaml", re.sub(r"^#([a-z_]+:)", r"\1", text, flags=re.M))
    got = load_settings_file(uncommented, specs)
    assert set(got) == set(documented)


# ------------------------------------------------------------------ through the start command


class RecordingRunner:
    """Stands in for AgentRunner: records the options instead of connecting anywhere."""

    seen: list[Any] = []

    def __init__(self, options: Any) -> None:
        RecordingRunner.seen.append(options)

    def run(self) -> int:
        return 0

    def stop(self) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    RecordingRunner.seen = []
    monkeypatch.setattr(edge_agent.runner, "AgentRunner", RecordingRunner)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        yield RecordingRunner.seen
    finally:  # `start` installs a SIGTERM handler that stops its runner; do not leave it in pytest
        signal.signal(signal.SIGTERM, sigterm)


KEY = public_text(Signer.generate().public)


def invoke(*args: str):
    return CliRunner(env={"COLUMNS": "400", "SFL_COORDINATOR_KEY": KEY}).invoke(app, ["start", *args])


def test_flags_win_over_the_file(tmp_path: Path, recorded: list[Any]):
    f = write(tmp_path / "etc" / "agent.yaml", """\
        profile: s2fl-low-low
        broker: mqtt://file-host:1883
        run: from-file
        index: 2
        seed: 5
        withhold_labels: true
        data: ../data
        agent_id: board-1
    """)
    r = invoke("--config", str(f), "--run", "from-flag", "--send-labels", "--seed", "9")
    assert r.exit_code == 0, r.output
    (opts,) = recorded
    assert opts.run_id == "from-flag" and opts.seed == 9 and opts.privacy.withhold_labels is False   # flags
    assert opts.index == 2 and opts.agent_id == "board-1" and opts.profile.name == "s2fl-low-low"  # file
    assert opts.broker.host == "file-host"
    assert opts.data_root == str((tmp_path / "etc").resolve() / "../data")
    assert opts.emulate is False   # neither: the option's default


def test_profile_flag_wins_and_a_profile_path_in_the_file_is_relative_to_it(tmp_path: Path, recorded: list[Any]):
    board = REPO / "profiles" / "devices" / "rpi4.yaml"
    write(tmp_path / "etc" / "devices" / "myboard.yaml", board.read_text())
    f = write(tmp_path / "etc" / "agent.yaml", "profile: devices/myboard.yaml\n")
    assert invoke("-c", str(f)).exit_code == 0
    assert recorded[-1].profile.name == "rpi4"   # the file's own 'name' field
    assert invoke("-c", str(f), "--profile", "jetson-nano").exit_code == 0
    assert recorded[-1].profile.name == "jetson-nano"


def test_missing_profile_is_a_clear_error(tmp_path: Path, recorded: list[Any]):
    f = write(tmp_path / "agent.yaml", "run: r1\n")
    r = invoke("--config", str(f))
    assert r.exit_code == 2
    assert "no device profile: give --profile NAME or 'profile:' in" in r.output
    r = invoke()
    assert r.exit_code == 2 and "no device profile" in r.output
    assert not recorded


def test_bad_file_is_a_usage_error_naming_the_key(tmp_path: Path, recorded: list[Any]):
    f = write(tmp_path / "agent.yaml", "profile: rpi4\nindx: 3\n")
    r = invoke("--config", str(f))
    assert r.exit_code == 2
    assert "field 'indx': unknown key; did you mean 'index'?" in r.output
    f = write(tmp_path / "agent.yaml", "profile: rpi4\nindex: 3.5\n")
    r = invoke("--config", str(f))
    assert r.exit_code == 2 and "field 'index': expected an integer, got 3.5" in r.output
    assert not recorded


def test_file_is_read_before_the_broker_is_contacted(tmp_path: Path):
    """A process, as systemd runs it: the profile comes from the file, so the agent gets as
    far as the broker (a closed port), not stopping on a missing --profile. A broker that cannot
    be reached yet (a device that boots before it) is tried again with a backoff for as long as
    the agent runs; SIGTERM ends the wait at once, exit 0."""
    port = free_port()
    f = tmp_path / "agent.yaml"
    f.write_text(yaml.safe_dump({"profile": "rpi4", "broker": f"mqtt://127.0.0.1:{port}", "run": "r1",
                                 "agent_id": "cfg-test", "coordinator_key": KEY}))
    log = tmp_path / "agent.log"
    p = subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--config", str(f)], cwd=REPO,
                         env={**os.environ, "COLUMNS": "400"}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "trying again in 10 s" not in log.read_text() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        out = log.read_text()
        assert p.poll() is None, out                                   # still there, waiting for the broker
        assert f"cannot reach MQTT broker at mqtt://127.0.0.1:{port}: [Errno 111] Connection refused: trying " \
               f"again in 5 s" in out, out
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "profile" not in log.read_text().lower()
