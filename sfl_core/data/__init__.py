"""Training data: the built-in data sets, their partition over agents, a device's own data, standardisation."""
