"""The coordinator daemon (`sfl-coord serve`): round engine, fleet session, server trainer, state, transports."""
