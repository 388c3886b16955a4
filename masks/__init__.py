"""The mask catalogue: one family per module, each registered under its snake_case name.

``get(name, **params)`` builds a registered spec, ``names()`` lists them, ``register`` adds a spec
class and ``register_function`` a plain ``mask_mod`` function.
"""

from flexattn_zoo.registry import MASKS

from .band import Band
from .block_diffusion import BlockDiffusion
from .block_select import BlockSelect
from .causal import Causal
from .chunked import Chunked
from .dense import Dense
from .dilated_sliding_window import DilatedSlidingWindow
from .document import Document
from .flamingo_cross import FlamingoCross
from .full import Full
from .global_window import GlobalWindow
from .natten import Natten
from .padding import KeyPadding
from .per_document import PerDocument
from .prefix_lm import PrefixLM
from .shared_prefix import SharedPrefix
from .sliding_tile import SlidingTile
from .sliding_window import SlidingWindow
from .tree import Tree
from .video_sparse import VideoSparse

get = MASKS.get
names = MASKS.names
register = MASKS.register
register_function = MASKS.register_function

__all__ = [
    "Band",
    "BlockDiffusion",
    "BlockSelect",
    "Causal",
    "Chunked",
    "Dense",
    "DilatedSlidingWindow",
    "Document",
    "FlamingoCross",
    "Full",
    "GlobalWindow",
    "KeyPadding",
    "Natten",
    "PerDocument",
    "PrefixLM",
    "SharedPrefix",
    "SlidingTile",
    "SlidingWindow",
    "Tree",
    "VideoSparse",
    "get",
    "names",
    "register",
    "register_function",
]
