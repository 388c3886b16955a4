"""``fz.viz``: matrices, text pictures and PNG heatmaps of masks and score mods, for one batch row
and head, from registry names, specs, raw callables and tensors; and ``flexattn-zoo show`` drawing
through it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods, viz
from flexattn_zoo.cli import app as cli
from flexattn_zoo.registry import MASKS
from flexattn_zoo.testing import spec_examples

B, H, LQ, LKV = 2, 3, 23, 31
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_fz_viz_is_the_module() -> None:
    assert fz.viz is importlib.import_module("flexattn_zoo.viz") is viz
    assert "viz" in fz.__all__
    from flexattn_zoo.cli import info

    assert info.viz is viz  # the CLI draws with the same functions


# ---- matrices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", masks.names())
def test_mask_matrix_is_the_oracle_for_every_registered_mask(name: str) -> None:
    for _, spec in spec_examples("mask", LQ, LKV, B, H, names=[name]):
        oracle = spec.dense(LQ, LKV, batch=B, heads=H).expand(B, H, LQ, LKV)
        for b, h in ((0, 0), (1, 2)):
            got = viz.mask_matrix(spec, LQ, LKV, batch_index=b, head_index=h, batch=B, heads=H)
            assert got.dtype == torch.bool and got.shape == (LQ, LKV) and got.device.type == "cpu"
            assert torch.equal(got, oracle[b, h]), (spec, b, h)


@pytest.mark.parametrize("name", score_mods.names())
def test_score_matrix_is_the_score_mod_on_zeros_and_on_given_scores(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    given = torch.randn(LQ, LKV, generator=gen, dtype=torch.float64) * 3
    for _, spec in spec_examples("score", LQ, LKV, B, H, names=[name]):
        zeros = spec.dense(torch.zeros(B, H, LQ, LKV, dtype=torch.float64))
        scored = spec.dense(given.expand(B, H, LQ, LKV).clone())
        for b, h in ((0, 0), (1, 2)):
            kw = {"batch_index": b, "head_index": h, "batch": B, "heads": H}
            bias = viz.score_matrix(spec, LQ, LKV, **kw)
            assert bias.dtype == torch.float64 and bias.shape == (LQ, LKV)
            torch.testing.assert_close(bias, zeros[b, h], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                viz.score_matrix(spec, LQ, LKV, scores=given, **kw), scored[b, h], rtol=1e-6, atol=1e-6
            )


def test_head_selection_matters_for_alibi() -> None:
    alibi = score_mods.Alibi(num_heads=8)
    dist = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs().double()
    slopes = [2.0 ** (-(h + 1)) for h in range(8)]  # Press et al. for 8 heads: 1/2, 1/4, ...
    for h in (0, 1, 7):
        # heads defaults to the spec's num_heads
        torch.testing.assert_close(viz.score_matrix(alibi, 6, head_index=h), -slopes[h] * dist)
    assert not torch.equal(viz.score_matrix(alibi, 6, head_index=0), viz.score_matrix(alibi, 6, head_index=1))
    assert viz.text(alibi, 3, head_index=1).splitlines()[0].split() == ["0.00", "-0.25", "-0.50"]
    # Given scores: the bias is added to them.
    scores = torch.full((6, 6), 2.0)
    torch.testing.assert_close(
        viz.score_matrix(alibi, 6, scores=scores, head_index=7), 2.0 - slopes[7] * dist
    )


def test_by_name_and_bound_to_the_lengths() -> None:
    assert torch.equal(viz.mask_matrix("causal", 5), torch.ones(5, 5, dtype=torch.bool).tril())
    # Bottom-right causal needs Lkv - Lq: the spec is bound to the lengths, as kernels run it.
    got = viz.mask_matrix(masks.Causal(align="bottom_right"), 2, 4)
    assert got.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert torch.equal(viz.heatmap("full", 3, 4), torch.ones(3, 4, dtype=torch.bool))
    torch.testing.assert_close(
        viz.heatmap(score_mods.SoftCap(cap=2.0), 2), torch.zeros(2, 2, dtype=torch.float64)
    )
    # Tensors, as fz.attention takes them: a bool mask, a float bias.
    mask = torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(1)) < 0.5
    assert torch.equal(viz.heatmap(mask, 4, 6, batch_index=1, batch=2), mask[1, 0])
    bias = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(viz.heatmap(bias, 4, 6), bias)


def test_per_head_block_selection() -> None:
    spec = masks.BlockSelect(indices=torch.tensor([[[[0], [1]], [[1], [0]]]]), block_size=2)
    assert viz.text(spec, 4, heads=2, head_index=0) == "##..\n##..\n..##\n..##"
    assert viz.text(spec, 4, heads=2, head_index=1) == "..##\n..##\n##..\n##.."
    with pytest.raises(ValueError, match="pass batch= and heads="):
        viz.mask_matrix(spec, 4)  # heads left out: drawn as one head, which the spec refuses


# ---- raw callables ----------------------------------------------------------------------------


def test_raw_mask_callables() -> None:
    def near(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx - kv_idx).abs() <= 1

    want = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs() <= 1
    assert torch.equal(viz.mask_matrix(near, 5), want) and torch.equal(viz.heatmap(near, 5), want)
    # Written for flex's scalar indices (a nested lookup): evaluated as flex does.
    table = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) < 0.5

    def lookup(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return table[q_idx][kv_idx]

    assert torch.equal(viz.mask_matrix(lookup, 5, 7), table)

    # One that reads the head: the head drawn matters.
    def per_head(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx <= q_idx + h

    assert viz.text(per_head, 3, heads=2, head_index=1) == "##.\n###\n###"
    assert viz.text(per_head, 3, heads=2, head_index=0) == "#..\n##.\n###"


def test_raw_score_callables() -> None:
    def tilt(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + (h + 1) * (q_idx - kv_idx)

    diff = (torch.arange(4)[:, None] - torch.arange(5)[None, :]).double()
    torch.testing.assert_close(viz.score_matrix(tilt, 4, 5, heads=3, head_index=2), 3 * diff)
    torch.testing.assert_close(viz.heatmap(tilt, 4, 5, head_index=1), 2 * diff)
    scores = torch.ones(4, 1)  # broadcast to [Lq, Lkv]
    torch.testing.assert_close(viz.score_matrix(tilt, 4, 5, scores=scores), 1 + diff)

    def gathered(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + weights[h][q_idx]

    weights = torch.tensor([[0.0, 1.0, 2.0], [5.0, 6.0, 7.0]])
    got = viz.score_matrix(gathered, 3, 2, heads=2, head_index=1)
    torch.testing.assert_close(got, torch.tensor([[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]], dtype=torch.float64))


# ---- text -------------------------------------------------------------------------------------


def test_text_pictures() -> None:
    assert viz.text("causal", 3, 4) == "#...\n##..\n###."
    # Downsampled: at most max_cells a side, '+' where a character is partly visible.
    lines = viz.text(masks.SlidingWindow(left=10), 200, max_cells=20).splitlines()
    assert len(lines) == 20 and all(len(line) == 20 for line in lines)
    assert set("".join(lines)) <= set("#+.") and "+" in "".join(lines)
    # A score mod above 16 x 16: shades from ' ' (lowest) to '@' (highest).
    shaded = viz.text(score_mods.Alibi(num_heads=2), 40, max_cells=10).splitlines()
    assert len(shaded) == 10 and shaded[0][0] == "@" and shaded[0][-1] == " "
    # Sampled past DENSE_LIMIT (never the whole mask).
    huge = viz.text("causal", 10_000, max_cells=8, kv_len=2_000).splitlines()
    assert len(huge) == 8 and huge[-1] == "########"


def test_shades_draw_hidden_keys_lowest() -> None:
    """-inf (a hidden key; a ReLU weight of 0) is the lowest score, +inf the highest: beside
    negative scores neither may be drawn as if it were 0."""
    i = torch.arange(20.0)
    distance = -(i[:, None] - i[None, :]).abs()  # 0 on the diagonal, negative elsewhere
    causal = distance.masked_fill(i[None, :] > i[:, None], float("-inf"))
    lines = viz.text(causal, 20).splitlines()
    assert all(line[r + 1 :].strip() == "" for r, line in enumerate(lines))  # hidden keys: ' '
    assert all(line[r] == "@" for r, line in enumerate(lines))  # the diagonal: the highest finite
    above = distance.masked_fill(i[None, :] > i[:, None], float("inf"))
    lines = viz.text(above, 20).splitlines()
    assert all(set(line[r:]) == {"@"} for r, line in enumerate(lines))
    assert lines[-1][0] == " "


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: viz.mask_matrix("causal", 4, head_index=1, heads=1),
            ValueError,
            r"head_index must be in \[0, heads = 1\)",
        ),
        (lambda: viz.mask_matrix("causal", 4, batch_index=-1), ValueError, "batch_index"),
        (lambda: viz.mask_matrix("causal", 4, head_index=True), TypeError, "head_index must be an int"),
        (lambda: viz.mask_matrix("causal", 0), ValueError, "q_len must be a positive int"),
        (lambda: viz.mask_matrix("causal", 4, "8"), TypeError, "kv_len"),
        (lambda: viz.mask_matrix("causal", 4, heads=0), ValueError, "heads"),
        (lambda: viz.mask_matrix("causal", 5000, 5000), ValueError, "DENSE_LIMIT"),
        (lambda: viz.mask_matrix(None, 4), TypeError, "not None"),
        (lambda: viz.mask_matrix("slidng_window", 4), ValueError, "Did you mean 'sliding_window'"),
        (lambda: viz.mask_matrix(score_mods.SoftCap(cap=1.0), 4), TypeError, "score spec"),
        (lambda: viz.heatmap("causl", 4), ValueError, "Did you mean 'causal'"),
        (lambda: viz.heatmap(lambda a, b: a, 4), TypeError, "mask_mod .* or a score_mod"),
        (lambda: viz.heatmap(3.0, 4), TypeError, "got float"),
        (
            lambda: viz.heatmap("causal", 4, scores=torch.zeros(4, 4)),
            ValueError,
            "scores= applies to score mods",
        ),
        (lambda: viz.score_matrix("softcap", 4), ValueError, "needs parameter"),
        (lambda: viz.score_matrix(score_mods.Alibi(num_heads=4), 4, heads=2), ValueError, "head"),
        (
            lambda: viz.score_matrix(score_mods.SoftCap(cap=1.0), 4, scores=torch.zeros(3, 4)),
            ValueError,
            "broadcast",
        ),
        (
            lambda: viz.score_matrix(
                score_mods.SoftCap(cap=1.0), 4, scores=torch.zeros(4, 4, dtype=torch.int64)
            ),
            TypeError,
            "floating",
        ),
        (lambda: viz.text("causal", 4, max_cells=0), ValueError, "max_cells"),
        (lambda: viz.text("causal", 2**53), ValueError, "at most 2\\*\\*52"),
    ],
)
def test_bad_arguments(call, exc: type[Exception], match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        call()


# ---- PNG --------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the viz extra) is not installed")
def test_write_png(tmp_path: Path) -> None:
    for name, spec, kw in (
        ("mask", masks.SlidingWindow(left=3), {}),
        ("score", score_mods.Alibi(num_heads=4), {"head_index": 2}),
        ("callable", lambda b, h, q, kv: kv <= q, {}),
        ("bias", score_mods.Bias(bias=torch.full((6, 6), -torch.inf).triu(1)), {}),  # -inf left blank
    ):
        target = tmp_path / f"{name}.png"
        viz.write_png(str(target), spec, 6, **kw)
        assert target.read_bytes()[:8] == PNG_MAGIC, name


def test_write_png_without_matplotlib_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(viz, "have_matplotlib", lambda: False)
    target = tmp_path / "m.png"
    with pytest.raises(viz.MissingDependency, match=r"pip install 'flexattn-zoo\[viz\]'"):
        viz.write_png(str(target), "causal", 8)
    with pytest.raises(viz.MissingDependency, match="matplotlib"):
        viz.write_cells_png(str(target), "t", torch.zeros(2, 2))
    assert not target.exists()
    # Checked before anything is computed: even a bad spec reports the missing dependency.
    with pytest.raises(viz.MissingDependency):
        viz.write_png(str(target), "no_such_mask", 8)
    # The CLI says so without a traceback (exit 1).
    code = cli.main(["show", "alibi", "--len", "4", "--heads", "2", "--png", str(target)])
    err = capsys.readouterr().err
    assert code == 1 and "pip install 'flexattn-zoo[viz]'" in err and "Traceback" not in err


# ---- flexattn-zoo show ------------------------------------------------------------------------


def test_block_codes_refuse_a_row_or_head_the_block_mask_does_not_store() -> None:
    """An index past a stored dimension raised nothing and drew the last row (-1 too); a dimension
    stored once (broadcast) serves every index."""
    ids = torch.tensor([[0] * 16 + [1] * 16, [0] * 32])
    bm = fz.block_mask(masks.Document(doc_ids=ids), 32, 32, batch=2, heads=1, block_size=16)
    assert viz.block_codes(bm, 32, 32, batch_index=0).tolist() == [[2, 0], [0, 2]]
    assert viz.block_codes(bm, 32, 32, batch_index=1, head_index=3).tolist() == [[2, 2], [2, 2]]
    for bad in (2, 5, -1):
        with pytest.raises(ValueError, match=r"batch_index must be in \[0, 2\)"):
            viz.block_codes(bm, 32, 32, batch_index=bad)
    with pytest.raises(ValueError, match="head_index"):
        viz.block_codes(bm, 32, 32, head_index=-1)
    with pytest.raises(TypeError, match="head_index must be an int"):
        viz.block_codes(bm, 32, 32, head_index=True)


def test_score_response_reads_batch_row_0_for_every_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Each input is scored at (batch 0, head, 0, 0): the inputs were laid along the batch axis, so
    a per-row spec read input n at row n, and Graphormer (sized to its batch and nodes) raised,
    a traceback out of ``flexattn-zoo show``."""
    per_row = score_mods.Bias(bias=torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 2).contiguous())
    assert viz.score_response(per_row, [0.0, 1.0, 5.0], heads=1) == [0.0, 1.0, 5.0]
    graph = score_mods.Graphormer(
        spatial_pos=torch.tensor([[[1, 0], [0, 1]], [[0, 0], [0, 0]]]),
        spatial_bias=torch.tensor([[0.5, 0.25], [1.5, 2.0]]),
    )
    assert viz.score_response(graph, [0.0, 1.0], heads=2, head_index=1) == [2.0, 3.0]
    argv = ["show", "graphormer", "--spatial-pos", "0,1;1,0", "--spatial-bias", "0.5,0.1;1.5,0.2"]
    code = cli.main([*argv, "--len", "2", "--heads", "2", "--head", "1"])
    captured = capsys.readouterr()
    assert code == 0 and "0.10 0.20" in captured.out and "Traceback" not in captured.err


def test_show_draws_a_score_mod_for_the_head_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["show", "alibi", "--len", "4", "--heads", "8", "--head", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "head 1 of 8" in out
    assert viz.text(score_mods.Alibi(num_heads=8), 4, head_index=1) in out  # -0.25 per step
    code = cli.main(["show", "alibi", "--len", "40", "--heads", "4", "--head", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "head 3 of 4" in out and "shaded" in out
    code = cli.main(["show", "alibi", "--len", "4", "--heads", "8", "--head", "8"])
    assert code == 2 and "--head must be in [0, 8)" in capsys.readouterr().err


def test_show_draws_a_mask_for_the_head_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    # A user mask that reads the head, registered by name as the CLI finds specs.
    masks.register_function("viz_test_per_head", lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + h)
    try:
        code = cli.main(["show", "viz_test_per_head", "--len", "3", "--heads", "2", "--head", "1"])
        out = capsys.readouterr().out
    finally:
        MASKS.unregister("viz_test_per_head")
    assert code == 0
    assert [line for line in out.splitlines() if line and set(line) <= set("#.")][:3] == ["##.", "###", "###"]


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the viz extra) is not installed")
def test_show_score_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "alibi.png"
    assert cli.main(["show", "alibi", "--len", "8", "--heads", "4", "--head", "2", "--png", str(target)]) == 0
    assert target.read_bytes()[:8] == PNG_MAGIC
