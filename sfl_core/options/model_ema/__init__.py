"""The delivered model average (``model_ema:``): an exponential moving average over rounds."""
