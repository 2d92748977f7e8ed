"""MergeSFL: its layer, its config section (``mergesfl:``) and its control algorithms."""
