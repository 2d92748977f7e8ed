# isort: skip_file  (the order of the imports below is the order of the commands in --help)
"""``sfl-agent``: the edge agent's command line (entry point ``cli.agent:app``).

One module per command group; each registers its commands on :data:`app` when imported.
"""

# Each module registers its commands on `app`; this order is the order `sfl-agent --help` lists them.
from cli.agent import run  # noqa: F401, I001
from cli.agent import device  # noqa: F401
from cli.agent.app import app

__all__ = ["app"]
