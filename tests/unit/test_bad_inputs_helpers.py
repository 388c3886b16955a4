"""Bad inputs to the helpers around attention: the page allocator's device, ``decode_step``'s
``return_lse``, the ``fz.testing`` checks and the ``fz.viz`` pictures. Each raises a clear
``ValueError``/``TypeError`` naming the argument; none passes silently (a NaN tolerance made
``assert_matches_reference`` accept anything) or fails deep inside torch."""

from __future__ import annotations

import typing
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import (
    assert_mask_consistent,
    assert_matches_reference,
    assert_score_consistent,
    spec_examples,
)

B, H, L, D = 1, 2, 8, 16
Q = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(0))
CACHE = torch.randn(B, H, 16, D, generator=torch.Generator().manual_seed(1))
CAP = score_mods.SoftCap(cap=5.0)


def _far_off() -> torch.Tensor:
    return fz.attention(Q, Q, Q) + 1.0  # far outside any tolerance


def _allocator(device: Any) -> Callable[[], Any]:
    return lambda: fz.pages.PageAllocator(4, 16, 2, batch=1, device=device)


ERRORS = [
    # the page allocator's device goes through the same check as fz.block_mask's
    pytest.param(
        _allocator("xyz"),
        ValueError,
        r"PageAllocator\(device=...\) must be a torch.device",
        id="pages_bad_str",
    ),
    pytest.param(
        _allocator("meta"),
        ValueError,
        r"PageAllocator\(device=...\) 'meta' has no attention route",
        id="pages_meta",
    ),
    # decode_step's return_lse is a bool, as fz.attention's (1 and 0 were taken as truthy/falsy)
    *(
        pytest.param(
            lambda flag=flag: fz.decode.decode_step(Q[:, :, :1], CACHE, CACHE, 4, return_lse=flag),
            TypeError,
            r"return_lse must be a bool",
            id=f"decode_return_lse_{flag!r}",
        )
        for flag in (1, 0)
    ),
    # fz.testing: tolerances that would make every comparison pass or fail
    *(
        pytest.param(
            lambda kw=kw: assert_matches_reference(_far_off(), Q, Q, Q, **kw),
            exc,
            rf"assert_matches_reference\({next(iter(kw))}=...\) must be a finite number >= 0",
            id=f"reference_{next(iter(kw))}_{label}",
        )
        for label, kw, exc in (
            ("nan", {"ratio": float("nan")}, ValueError),
            ("negative", {"ratio": -1.0}, ValueError),
            ("str", {"ratio": "2"}, TypeError),
            ("nan", {"floor_ulps": float("nan")}, ValueError),
            ("inf", {"floor_ulps": float("inf")}, ValueError),
        )
    ),
    *(
        pytest.param(
            lambda kw=kw: assert_score_consistent(CAP, **kw),
            ValueError,
            rf"assert_score_consistent\({next(iter(kw))}=...\) must be a finite number",
            id=f"score_consistent_{next(iter(kw))}_nan",
        )
        for kw in ({"rtol": float("nan")}, {"atol": float("nan")}, {"magnitude": float("nan")})
    ),
    # fz.testing: the spec's kind and the problem's sizes
    pytest.param(
        lambda: assert_mask_consistent("causal", 8, 8),  # type: ignore[arg-type]
        TypeError,
        r"assert_mask_consistent\(spec=...\) must be a mask spec .*got str \(build it first: masks.get",
        id="mask_consistent_name",
    ),
    pytest.param(
        lambda: assert_mask_consistent(CAP, 8, 8),  # type: ignore[arg-type]
        TypeError,
        r"assert_mask_consistent\(spec=...\) must be a mask spec .*got SoftCap",
        id="mask_consistent_score_spec",
    ),
    pytest.param(
        lambda: assert_mask_consistent(masks.Causal(), -1, 8),
        ValueError,
        r"assert_mask_consistent\(q_len=...\) must be an int >= 0, got -1",
        id="mask_consistent_negative_length",
    ),
    pytest.param(
        lambda: assert_score_consistent("softcap"),  # type: ignore[arg-type]
        TypeError,
        r"assert_score_consistent\(spec=...\) must be a score spec .*score_mods.get",
        id="score_consistent_name",
    ),
    pytest.param(
        lambda: assert_score_consistent(CAP, heads=0),
        ValueError,
        r"assert_score_consistent\(heads=...\) must be an int >= 1",
        id="score_consistent_zero_heads",
    ),
    pytest.param(
        lambda: spec_examples("mask", 8, 8, names=["causl"]),
        ValueError,
        r"spec_examples\(names=...\): unknown mask 'causl'.*Did you mean 'causal'",
        id="spec_examples_unknown_name",
    ),
    pytest.param(
        lambda: spec_examples("mask", 8, 8, names="causal"),  # type: ignore[arg-type]
        TypeError,
        r"spec_examples\(names=...\) must be a list of registry names",
        id="spec_examples_names_str",
    ),
    # fz.testing: argument types the checks read without looking
    pytest.param(
        lambda: assert_matches_reference([0.0], Q, Q, Q),  # type: ignore[arg-type]
        TypeError,
        r"assert_matches_reference\(out=...\) must be a tensor, got list",
        id="reference_out_list",
    ),
    pytest.param(
        lambda: fz.testing.dense_attention(Q, Q, Q, dtype=torch.int64),
        TypeError,
        r"dense_attention\(dtype=...\) must be a floating torch.dtype",
        id="dense_attention_int_dtype",
    ),
    # fz.decode.pool_view: any kv_layout but "NHD" was read as "HND"
    pytest.param(
        lambda: fz.decode.pool_view(POOL, "nhd"),
        ValueError,
        r"pool_view kv_layout must be 'NHD' or 'HND'; got 'nhd'",
        id="pool_view_layout",
    ),
    pytest.param(
        lambda: fz.decode.pool_view([0.0], "NHD"),  # type: ignore[arg-type]
        TypeError,
        r"pool_view pool must be a torch.Tensor, got list",
        id="pool_view_list",
    ),
    pytest.param(
        lambda: fz.decode.pool_view(POOL[0], "NHD"),
        ValueError,
        r"pool_view pool must be \[n_pages, page_size, Hkv, D\]",
        id="pool_view_3d",
    ),
    # fz.viz
    pytest.param(
        lambda: fz.viz.mask_cells("causal", 8, 8, max_cells=0),
        ValueError,
        r"max_cells must be a positive int, got 0",
        id="viz_mask_cells_zero",
    ),
    pytest.param(
        lambda: fz.viz.block_codes("causal", 8, 8),
        TypeError,
        r"block_codes\(block_mask=...\) must be a BlockMask",
        id="viz_block_codes_name",
    ),
    pytest.param(
        lambda: fz.viz.block_counts(masks.Causal(), 8, 8),
        TypeError,
        r"block_counts\(block_mask=...\) must be a BlockMask",
        id="viz_block_counts_spec",
    ),
    pytest.param(
        lambda: fz.viz.score_response(CAP, [1.0], heads=0),
        ValueError,
        r"heads must be a positive int, got 0",
        id="viz_score_response_zero_heads",
    ),
    pytest.param(
        lambda: fz.viz.score_response(CAP, [1.0], heads=2, head_index=2),
        ValueError,
        r"head_index must be in \[0, heads = 2\), got 2",
        id="viz_score_response_head_index",
    ),
    pytest.param(
        lambda: fz.viz.score_response(masks.Causal(), [1.0], heads=1),  # type: ignore[arg-type]
        TypeError,
        r"got a mask spec \(Causal\)",
        id="viz_score_response_mask_spec",
    ),
]


def _nested(*shape: int) -> torch.Tensor:
    # A strided (not jagged) nested tensor is a plain torch.Tensor whose .shape raises. torch warns
    # once per process that the API is a prototype.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(*shape[1:])] * shape[0])


CU = torch.tensor([0, 3, 8], dtype=torch.int32)
POOL = torch.zeros(4, 16, H, D)  # an NHD pool: [n_pages, page_size, Hkv, D]
NEW = torch.zeros(1, H, 1, D)
NESTED = [
    pytest.param(
        lambda: fz.varlen_attention(
            _nested(8, H, D), Q[0].transpose(0, 1), Q[0].transpose(0, 1), CU, CU, 5, 5
        ),
        r"q must be a dense",
        id="varlen_q",
    ),
    pytest.param(
        lambda: fz.decode.decode_step(_nested(B, H, 1, D), CACHE, CACHE, 4),
        r"decode_step q must be a dense",
        id="decode_q",
    ),
    pytest.param(
        lambda: fz.decode.decode_step(Q[:, :, :1], _nested(B, H, 16, D), CACHE, 4),
        r"decode_step k_cache must be a dense",
        id="decode_k_cache",
    ),
    pytest.param(
        lambda: fz.decode.append_kv(
            POOL, POOL, torch.zeros(1, 2, dtype=torch.int32), 0, _nested(1, H, 1, D), NEW, kv_layout="NHD"
        ),
        r"append_kv k_new must be a dense",
        id="append_kv_k_new",
    ),
    pytest.param(
        lambda: fz.pages.PageAllocator(4, 16, 2, batch=1).append(POOL, POOL, _nested(1, H, 1, D), NEW),
        r"PageAllocator k_new must be a dense",
        id="allocator_append",
    ),
    pytest.param(
        lambda: fz.decode.pool_view(_nested(4, 16, H, D), "NHD"),
        r"pool_view pool must be a dense",
        id="pool_view",
    ),
]


@pytest.mark.parametrize(("call", "match"), NESTED)
def test_nested_tensors_get_a_type_error_naming_the_argument(call: Callable[[], Any], match: str) -> None:
    # torch's own error was a RuntimeError, "NestedTensorImpl doesn't support sizes"
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize(("call", "exc", "match"), ERRORS)
def test_bad_input_raises_clear_error(call: Callable[[], Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_page_allocator_on_an_absent_cuda_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"PageAllocator\(device=...\) 'cuda' is not available"):
        _allocator("cuda")()


def test_the_helpers_still_take_good_input() -> None:
    assert fz.pages.PageAllocator(4, 16, 2, batch=1, device=torch.device("cpu")).device.type == "cpu"
    out, lse = fz.decode.decode_step(Q[:, :, :1], CACHE, CACHE, 4, return_lse=True)
    assert out.shape == (B, H, 1, D) and lse.shape == (B, H, 1)
    assert_matches_reference(fz.attention(Q, Q, Q), Q, Q, Q, ratio=2, floor_ulps=4)  # ints are numbers
    found = spec_examples("mask", 8, 8, names=("causal",))  # any sequence of names
    assert found and {name for name, _ in found} == {"causal"}
    assert fz.viz.score_response(CAP, [0.0, 1e9], heads=2, head_index=1) == pytest.approx([0.0, 5.0])


def _sweep(**case: Any) -> Callable[[], Any]:
    from flexattn_zoo.bench.config import parse_config

    base = {"name": "c", "batch": 1, "heads": 2, "seq_len": 64, "head_dim": 16}
    return lambda: parse_config({"cases": [{**base, **case}]})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        # NaN is not > 0, but it passed "v <= 0": no route would ever be skipped as too large
        pytest.param(
            _sweep(max_dense_gib=float("nan")), r"max_dense_gib must be a positive number", id="nan_gib"
        ),
        # draws past seq_len were cut to it: no padding / one document, whatever the range said
        pytest.param(
            _sweep(key_padding={"min": 100, "max": 200}),
            r"key_padding.max is 200, past seq_len 64",
            id="key_padding_past_seq_len",
        ),
        pytest.param(
            _sweep(document_lengths={"min": 100, "max": 200}),
            r"document_lengths.min is 100, past seq_len 64",
            id="documents_past_seq_len",
        ),
        # a list as a name was "unhashable type: 'list'"
        pytest.param(
            _sweep(mask={"name": ["causal"]}), r"mask: mask name must be a str, got list", id="list_name"
        ),
        pytest.param(
            _sweep(score_mod={"name": ["alibi"]}),
            r"score_mod: score_mod name must be a str, got list",
            id="list_score_name",
        ),
    ],
)
def test_sweep_config_errors_name_the_key(call: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("as_score", [False, True], ids=["mask", "score_mod"])
def test_a_spec_holding_meta_tensors_is_refused_by_name(as_score: bool) -> None:
    # torch's error was "Tensor.item() cannot be called on meta tensors", from the spec's checks
    if as_score:
        kw: dict[str, Any] = {"score_mod": score_mods.Bias(bias=torch.zeros(L, L, device="meta"))}
    else:
        kw = {"mask": masks.KeyPadding(valid=torch.ones(B, L, dtype=torch.bool, device="meta"))}
    arg = next(iter(kw))
    with pytest.raises(ValueError, match=rf"{arg}: \w+ holds a tensor on the meta device .*q is on cpu"):
        fz.attention(Q, Q, Q, **kw)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        # recorded and never matched: nothing was rebuilt, silently
        pytest.param(
            lambda: fz.invalidate("causal"),
            TypeError,
            r"fz.invalidate\(fn=...\) takes the mask_mod",
            id="invalidate_name",
        ),
        pytest.param(
            lambda: fz.invalidate(masks.Causal()),
            TypeError,
            r"got Causal \(a spec's own tensors",
            id="invalidate_spec",
        ),
        # AttributeError ('str' object has no attribute 'device') before
        pytest.param(
            lambda: fz.tune.clear("x"),
            TypeError,
            r"fz.tune.clear\(signature=...\) must be a Signature",
            id="tune_clear",
        ),
        # torch's RuntimeError for a malformed device string before
        pytest.param(
            lambda: fz.tune.cache_path("xyz"),
            ValueError,
            r"fz.tune.cache_path\(device=...\) must be a torch.device",
            id="tune_cache_path",
        ),
    ],
)
def test_cache_controls_refuse_what_they_cannot_act_on(
    call: Callable[[], Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        call()
    fz.invalidate(lambda b, h, q, k: q >= k)  # a callable still works
    assert fz.tune.cache_path("cpu") == fz.tune.cache_path(torch.device("cpu"))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"BACKEND": "NOPE"}, r"kernel_options\['BACKEND'\] must be one of 'AUTO', .*got 'NOPE'"),
        ({"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True}, r"BACKEND supersedes the legacy FORCE_USE"),
    ],
    ids=["unknown_backend", "backend_and_force"],
)
def test_kernel_options_torch_refuses_are_refused_before_the_compile(
    options: dict[str, Any], match: str
) -> None:
    # flex_attention raised these inside the compiled call: Dynamo's "Unsupported: Observed exception"
    from torch.nn.attention import flex_attention

    if "AUTO" not in typing.get_args(getattr(flex_attention, "_Backend", None)):
        pytest.skip("this torch's flex_attention has no BACKEND option")
    with pytest.raises(ValueError, match=match):
        fz.attention(Q, Q, Q, mask="causal", kernel_options=options)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"spec": "causal"},
            TypeError,
            r"DecodeMask\(spec=...\) must be a mask spec .*got str",
        ),  # AttributeError: bind
        (
            {"q_block_size": 0},
            ValueError,
            r"DecodeMask\(q_block_size=...\) must be an int >= 1",
        ),  # ZeroDivisionError
        (
            {"n_physical": -1},
            ValueError,
            r"DecodeMask\(n_physical=...\) must be an int >= 1",
        ),  # torch RuntimeError
        ({"batch": 0}, ValueError, r"DecodeMask\(batch=...\) must be an int >= 1"),
        (
            {"device": "xyz"},
            ValueError,
            r"DecodeMask\(device=...\) must be a torch.device",
        ),  # torch RuntimeError
    ],
    ids=["spec_name", "q_block_zero", "negative_pages", "no_rows", "device_string"],
)
def test_decode_mask_refuses_bad_arguments(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"spec": masks.Causal(), "batch": 1, "q_len": 1, "capacity": 64, **kwargs}
    with pytest.raises(exc, match=match):
        fz.decode.DecodeMask(
            args.pop("spec"), args.pop("batch"), args.pop("q_len"), args.pop("capacity"), **args
        )


def test_rel_pos_bias_refuses_a_max_distance_its_lookup_cannot_hold() -> None:
    # the 2 * max_distance + 1 entry lookup is built with the spec: 10**12 was torch's
    # "DefaultCPUAllocator: can't allocate memory" RuntimeError
    table = torch.zeros(32, H)
    with pytest.raises(
        ValueError, match=r"RelPosBias\(max_distance=...\) must be in \[9, 16777216\], got 10{12}"
    ):
        score_mods.RelPosBias(table=table, max_distance=10**12)
    assert score_mods.RelPosBias(table=table, max_distance=1024).max_distance == 1024


@pytest.mark.parametrize(("q_rows", "k_rows"), [(0, 0), (0, 8), (8, 0)])
def test_varlen_attention_of_an_empty_pack_is_attentions_zero_length_result(q_rows: int, k_rows: int) -> None:
    # an empty pack failed with a message about a Document of zero positions, a spec the caller
    # never gave; fz.attention's zero lengths give no rows, or rows that see no key (0, lse -inf)
    x = torch.randn(8, H, D)
    q, k = x[:q_rows], x[:k_rows]
    cu_q = torch.tensor([0, q_rows // 2, q_rows], dtype=torch.int32)
    cu_k = torch.tensor([0, k_rows // 2, k_rows], dtype=torch.int32)
    out, lse = fz.varlen_attention(q, k, k, cu_q, cu_k, q_rows, k_rows, causal=True, return_lse=True)
    assert out.shape == (q_rows, H, D) and lse.shape == (H, q_rows)
    assert not out.any() and bool(torch.isneginf(lse).all())


def test_varlen_offsets_on_the_meta_device_are_refused_by_name() -> None:
    x = torch.randn(8, H, D)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k is on the meta device"):  # NotImplementedError before
        fz.varlen_attention(x, x, x, cu, cu.to("meta"), 5, 5)


def test_registering_under_a_non_str_name_is_a_type_error_naming_it() -> None:
    # re.match's "expected string or bytes-like object, got 'int'" named no argument
    with pytest.raises(TypeError, match=r"mask name must be a snake_case str, got int"):
        masks.register_function(3, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"score_mod name must be a snake_case str, got tuple"):
        score_mods.register_function(("a",), lambda s, b, h, q_idx, kv_idx: s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n_pages", "page_size", "max_pages"), [(2**40, 16, 4), (2**12, 2**20, 2**12)], ids=["pages", "row"]
)
def test_page_allocator_sizes_must_fit_its_int32_tables(n_pages: int, page_size: int, max_pages: int) -> None:
    # 2**40 pages was a MemoryError building the free list; a row of 2**32 tokens was accepted,
    # though its length cannot be held by the int32 cache_len
    with pytest.raises(ValueError, match=r"must be at most 2\*\*31 - 1: block_table and cache_len are int32"):
        fz.pages.PageAllocator(n_pages, page_size, max_pages, batch=1)
