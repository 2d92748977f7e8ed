"""The learning rate annealed over the last rounds of the run (``lr_anneal:``)."""
