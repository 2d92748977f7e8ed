"""Run configs and device profiles: one-line errors, shared field checks, the generated reference."""
