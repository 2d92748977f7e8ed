"""Server optimisers (``server_opt:``): FedAvgM, FedAdam, FedYogi on the aggregate."""
