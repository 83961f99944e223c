"""DMS training: the base model, chain-of-thought data, gate labels, the retrofit, the threshold fit, KV-growth measurement."""
