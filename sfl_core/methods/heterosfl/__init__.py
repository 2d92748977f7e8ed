"""HeteroSFL: its layer, its config section (``hetero:``) and its link-rate groups."""
