"""The server's calibrated loss (``loss: calibrated``): FedLC's logit calibration."""
