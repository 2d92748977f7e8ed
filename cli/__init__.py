"""The command lines: ``sfl-coord`` (:mod:`cli.coord`) and ``sfl-agent`` (:mod:`cli.agent`).

Entry points only: the commands parse options, call the library (``coordinator``,
``edge_agent``, ``simulation``, ``sfl_core``) and turn its exceptions into one line and an exit
status. Nothing imports this package.
"""
