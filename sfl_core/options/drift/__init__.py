"""Drift correction (``drift:``): FedProx and SCAFFOLD, its section, hooks and control variates."""
