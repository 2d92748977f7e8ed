"""What the coordinator and the agents share: configs, models, data, the wire, the time model, the methods."""
