"""The score-mod catalogue: one family per module, each registered by name.

Chain score specs with ``a >> b`` (``a`` first, then ``b``), e.g.
``Alibi(num_heads=16) >> SoftCap(cap=30.0)``; ``Chain(mods=(a, b))`` is the same spec.
"""

from flexattn_zoo.compose import Chain
from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreSpec

from .activation import Relu, Sigmoid
from .alibi import Alibi
from .bias import Bias
from .graphormer import Graphormer
from .rel_pos_bias import RelPosBias
from .sandwich import Sandwich
from .softcap import SoftCap

get = SCORES.get
names = SCORES.names
register = SCORES.register
register_function = SCORES.register_function
unregister = SCORES.unregister

__all__ = [
    "Alibi",
    "Bias",
    "Chain",
    "Graphormer",
    "RelPosBias",
    "Relu",
    "Sandwich",
    "ScoreSpec",
    "Sigmoid",
    "SoftCap",
    "get",
    "names",
    "register",
    "register_function",
    "unregister",
]
