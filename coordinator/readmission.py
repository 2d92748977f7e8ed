"""An operator's requests to readmit quarantined agents, as files in the run's output directory.

``sfl-coord agents readmit RUN_DIR ID`` writes ``RUN_DIR/readmit/ID``; the coordinator serving
the run reads the folder before each round, clears the agent's quarantine, says so in its log
and removes the file. A run that is not serving picks the request up when it is resumed. A
file, not a network call: the operator who may readmit is whoever may write the run's files,
and nothing listens for it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Mapping

from sfl_core.fleet import AgentInfo
from sfl_core.wire import protocol

log = logging.getLogger("sfl.coord")

READMIT_DIR = "readmit"


def request_readmission(run_dir: Path, agent_id: str) -> Path:
    """Ask the run's coordinator to readmit ``agent_id`` (validated as an agent id)."""
    agent_id = protocol.check_id("agent id", agent_id)
    folder = Path(run_dir) / READMIT_DIR
    folder.mkdir(exist_ok=True)
    path = folder / agent_id
    path.write_text("readmit\n")
    return path


def apply_readmissions(run_dir: Path, agents: Mapping[str, AgentInfo], notice: Callable[[str], None]) -> list[str]:
    """Clear the quarantine of every agent an operator asked to readmit; the agents readmitted.
    A request for an agent not quarantined (or unknown) is dropped with a line saying so."""
    folder = Path(run_dir) / READMIT_DIR
    if not folder.is_dir():
        return []
    done = []
    for path in sorted(folder.iterdir()):
        name = path.name
        info = agents.get(name)
        if info is not None and info.quarantined:
            info.quarantined = ""
            done.append(name)
            notice(f"readmitted {name} at an operator's request: it may be selected again")
        else:
            notice(f"readmit request for {name} ignored: {'no such agent' if info is None else 'not quarantined'}")
        try:
            path.unlink()
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc.strerror or exc)
    return done
