"""BatchNorm statistics (``norm_stats:``): federated statistics passes, FixBN, FedBN."""
