"""The score-mod catalogue."""

from flexattn_zoo.registry import SCORES

get = SCORES.get
names = SCORES.names
register = SCORES.register
register_function = SCORES.register_function
