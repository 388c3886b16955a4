"""flexattn_zoo (bootstrap __init__: the full one is restored once dispatch lands)."""
from flexattn_zoo import masks, score_mods  # noqa: F401
