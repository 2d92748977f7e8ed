"""sfl_core."""
