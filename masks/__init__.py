"""The mask catalogue: one family per module, each registered under its snake_case name.

``get(name, **params)`` builds a registered spec, ``names()`` lists them, ``register`` adds a spec
class and ``register_function`` a plain ``mask_mod`` function.
"""

from flexattn_zoo.registry import MASKS

from .band import Band
from .causal import Causal
from .chunked import Chunked
from .dense import Dense
from .document import Document
from .full import Full
from .padding import KeyPadding
from .prefix_lm import PrefixLM
from .sliding_window import SlidingWindow

get = MASKS.get
names = MASKS.names
register = MASKS.register
register_function = MASKS.register_function

__all__ = [
    "Band",
    "Causal",
    "Chunked",
    "Dense",
    "Document",
    "Full",
    "KeyPadding",
    "PrefixLM",
    "SlidingWindow",
    "get",
    "names",
    "register",
    "register_function",
]
