"""Simulated fleets on the real round engine: :func:`run_simulation`."""

from simulation.run import run_simulation

__all__ = ["run_simulation"]
