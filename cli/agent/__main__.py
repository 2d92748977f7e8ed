"""``python -m cli.agent``: the same as ``sfl-agent``."""

from cli.agent import app

app(prog_name="sfl-agent")
