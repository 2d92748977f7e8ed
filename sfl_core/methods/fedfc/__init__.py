"""FedFC: its layer (a cut per device profile) and its config section (``fedfc:``)."""
