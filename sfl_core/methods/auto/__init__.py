"""``strategy: auto``, the joint planner: its method, its config section and its planner."""
