# isort: skip_file  (the order of the imports below is the order of the commands in --help)
"""``sfl-coord``: the coordinator's command line (entry point ``cli.coord:app``).

One module per command group; each registers its commands on :data:`app` when imported.
"""

# Each module registers its commands on `app`; this order is the order `sfl-coord --help` lists them.
from cli.coord import run  # noqa: F401, I001
from cli.coord import plan  # noqa: F401
from cli.coord import ops  # noqa: F401
from cli.coord import agents  # noqa: F401
from cli.coord.app import app

__all__ = ["app"]
