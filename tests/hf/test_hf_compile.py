"""Hugging Face models with flexattn_zoo attention inside ``torch.compile(fullgraph=True)``.

Training-style forwards (``use_cache=False``): Llama (causal) and Mistral (sliding window, whose
mask closure transformers builds inside the forward) compile without a graph break and give the
eager logits.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexattn_zoo.hf as zhf  # noqa: E402

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@pytest.mark.parametrize(
    ("config_name", "extra"), [("LlamaConfig", {}), ("MistralConfig", {"sliding_window": 16})]
)
def test_compiled_model_has_no_graph_break(config_name: str, extra: dict[str, int]) -> None:
    name = zhf.register()
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
    ids = torch.randint(0, 128, (2, 48))

    def logits(i: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, use_cache=False).logits

    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(logits)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(logits, fullgraph=True)(ids)
        torch.testing.assert_close(compiled, logits(ids), atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()
