"""S2FL: its method, its config section (``s2fl:``), the sliding split and the data-balance groups."""
