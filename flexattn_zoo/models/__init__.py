"""What model code builds on the core: the ``fz.Attention`` module (layers), named model presets,
KV-cache decoding (decode) and attention sinks."""
