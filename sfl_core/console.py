"""How both command-line programs print a message an operator acts on."""

from __future__ import annotations

from rich.console import Console


def say(console: Console, text: str, style: str = "red") -> None:
    """One line, never wrapped (journald, log files and grep see it whole), and no markup read
    from the text: a path like ``bad[bold]x.yaml`` prints as written."""
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)
