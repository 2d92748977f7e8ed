"""Training options beside the methods: drift correction, server optimisers, BatchNorm
statistics, the delivered model average. The seam is :mod:`.base`; each option is a folder with
its section, its hooks and its mathematics; the registry is :mod:`sfl_core.option_registry`."""
