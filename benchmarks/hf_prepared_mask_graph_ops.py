"""Graph ops of a four-layer compiled forward through the transformers attention function, with a
mask prepared before the forward (static-cache generate) and with one built inside the graph, and
how often each mask is translated into a zoo spec. CPU; needs transformers.

    PYTHONPATH=. python benchmarks/hf_prepared_mask_graph_ops.py

(Thirty-second session: translating a prepared mask when made, instead of in the first trace,
gave 312 graph ops instead of 79 for the prepared mask: each layer built its own BlockMask.)
"""

import torch
from transformers import masking_utils as mu
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import flexattn_zoo.hf as zhf
from flexattn_zoo.hf import mask_reader

name = zhf.register()
attend = ALL_ATTENTION_FUNCTIONS[name]
build = mu.ALL_MASK_ATTENTION_FUNCTIONS[name]
B, H, L, D = 2, 2, 128, 16
n = [0]
orig = mask_reader.translate


def counting(m):
    n[0] += 1
    return orig(m)


mask_reader.translate = counting


def mask_of(t):
    fn = mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(32))
    return build(batch_size=B, q_length=L, kv_length=L, mask_function=fn, attention_mask=t.to(torch.long))


valid = torch.arange(L) < torch.tensor([[100], [128]])


def four(q, k, v, m):
    for _ in range(4):
        q = attend(None, q, k, v, m, scaling=0.25)[0].transpose(1, 2)
    return q


q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
prepared = mask_of(valid)
print("translations when made eagerly:", n[0])
ex = torch._dynamo.explain(four)(q, k, v, prepared)
print(
    "prepared: graph ops",
    ex.ops_per_graph and sum(len(o) for o in ex.ops_per_graph),
    "breaks",
    ex.graph_break_count,
    "translations",
    n[0],
)
n[0] = 0
ex = torch._dynamo.explain(lambda q, k, v, t: four(q, k, v, mask_of(t)))(q, k, v, valid)
print(
    "in graph: graph ops",
    sum(len(o) for o in ex.ops_per_graph),
    "breaks",
    ex.graph_break_count,
    "translations",
    n[0],
)
