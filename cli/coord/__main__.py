"""``python -m cli.coord``: the same as ``sfl-coord`` (torchrun starts server workers this way)."""

from cli.coord import app

app(prog_name="sfl-coord")
