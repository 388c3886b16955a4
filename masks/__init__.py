"""The mask catalogue (filled in by the zoo families)."""

from flexattn_zoo.registry import MASKS

get = MASKS.get
names = MASKS.names
register = MASKS.register
register_function = MASKS.register_function
