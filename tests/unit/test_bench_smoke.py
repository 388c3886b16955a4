"""The benchmark harness: the CPU smoke sweep gives one well-formed row per (case, route, mode).

Routes that cannot run a case give ``unsupported`` rows with the dispatcher's reasons, failures
give ``error``/``OOM`` rows, never a crash.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from flexattn_zoo import masks, score_mods
from flexattn_zoo.bench import routes
from flexattn_zoo.bench import runner as bench
from flexattn_zoo.bench.config import load_config, packaged_configs, parse_config
from flexattn_zoo.bench.report import markdown, summary
from flexattn_zoo.bench.timing import dense_mask, visible_pairs
from flexattn_zoo.cli import app as cli
from flexattn_zoo.spec import spec_dataclass
from flexattn_zoo.testing import reference_attention

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "benchmarks" / "configs" / "smoke.yaml"
H200 = ROOT / "benchmarks" / "configs" / "h200.yaml"
ROW_KEYS = {
    "case",
    "route",
    "mode",
    "ms",
    "host_ms",
    "tflops",
    "peak_mib",
    "compile_s",
    "blockmask_s",
    "status",
    "reason",
    "chosen",
    "max_err",
    "err_vs",
    "visible_pairs",
    "density",
    "flops",
    "notes",
}
ENV_KEYS = {"torch", "triton", "cuda", "cudnn", "gpu", "cc", "flash_attn_cute", "command"}
STATUSES = {"ok", "unsupported", "OOM", "error"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    rc = bench.main([str(SMOKE), "--out", str(out / "smoke.json"), "--md", str(out / "smoke.md"), "--quiet"])
    return rc, json.loads((out / "smoke.json").read_text()), (out / "smoke.md").read_text()


def _rows(data: dict[str, Any], **match: str) -> list[dict[str, Any]]:
    return [r for r in data["rows"] if all(r[k] == v for k, v in match.items())]


def test_smoke_json_structure(smoke: tuple[int, dict[str, Any], str]) -> None:
    rc, data, _ = smoke
    assert rc == 0
    assert set(data) == {"env", "rows"}
    assert ENV_KEYS <= set(data["env"])
    assert "smoke.yaml" in data["env"]["command"]
    expected = [(c.name, r, m) for c in load_config(SMOKE) for m in c.modes for r in c.routes]
    got = [(r["case"], r["route"], r["mode"]) for r in data["rows"]]
    assert sorted(got) == sorted(expected)  # every row exactly once
    for row in data["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["status"] in STATUSES
        if row["status"] == "ok":
            assert row["ms"] > 0 and row["tflops"] > 0 and row["compile_s"] >= 0
            assert row["peak_mib"] is None  # CPU
        else:
            assert row["reason"], row
            assert row["ms"] is None and row["tflops"] is None


def test_smoke_unsupported_and_error_rows(smoke: tuple[int, dict[str, Any], str]) -> None:
    _, data, _ = smoke
    for row in _rows(data, route="flex_cpu", mode="fwdbwd"):
        assert row["status"] == "unsupported" and "backward" in row["reason"]
    (softcap,) = _rows(data, case="sliding_softcap", route="sdpa_dense_mask", mode="fwd")
    assert softcap["status"] == "unsupported" and "SoftCap" in softcap["reason"]
    (math_row,) = _rows(data, case="sliding_softcap", route="sdpa_math", mode="fwd")
    assert math_row["status"] == "unsupported" and "SDPA form" in math_row["reason"]
    (raw_bwd,) = _rows(data, case="causal", route="raw_flex", mode="fwdbwd")
    assert raw_bwd["status"] == "error" and "backward" in raw_bwd["reason"]  # CPU flex has no backward


def test_smoke_ok_rows_agree_and_record_choices(smoke: tuple[int, dict[str, Any], str]) -> None:
    _, data, _ = smoke
    for row in _rows(data, route="auto"):
        assert row["status"] == "ok" and row["chosen"]
    fwd = [r for r in _rows(data, mode="fwd", status="ok") if r["err_vs"]]
    assert fwd, "fwd rows are compared with the first route's output"
    for row in fwd:
        assert row["max_err"] < 1e-4, row  # float32: every exact route agrees
    for row in _rows(data, case="document_alibi", route="sdpa_dense_mask"):  # the float-bias path
        assert row["status"] == "ok" and row["blockmask_s"] is not None
    (flex,) = _rows(data, case="causal", route="flex_cpu", mode="fwd")
    assert flex["blockmask_s"] is not None
    (causal,) = _rows(data, case="causal", route="auto", mode="fwd")
    assert causal["visible_pairs"] == 2 * 256 * 257 // 2


def test_smoke_markdown(smoke: tuple[int, dict[str, Any], str]) -> None:
    _, data, md = smoke
    assert data["env"]["command"] in md
    assert "| case | mode |" in md and "auto/best" in md and "sdpa_dense_mask" in md
    assert "n/a" in md and "has no backward" in md
    assert "goal (auto)" in md and "1e-06: met" in md and "1e+06: NOT met" in md


def test_visible_pairs_match_dense_oracle() -> None:
    cpu = torch.device("cpu")
    specs = [
        masks.Causal(),
        masks.SlidingWindow(left=7),
        masks.Document.from_lengths([10, 30, 60]) & masks.Causal(),
        masks.PrefixLM(prefix_len=torch.tensor([5, 40])),  # depends on the batch index
    ]
    for spec in specs:
        dense = spec.dense(100, 100, batch=2, heads=3)
        expected = int(dense.expand(2, 3, 100, 100).sum())
        assert visible_pairs(spec, 100, 2, 3, cpu) == expected
        assert torch.equal(
            dense_mask(spec, 100, 2, 3, cpu).expand(2, 3, 100, 100), dense.expand(2, 3, 100, 100)
        )
    assert visible_pairs(None, 10, 2, 3, cpu) == 600


@spec_dataclass
class _UserBias(score_mods.Alibi):
    """A user's linear-bias spec under its own name: additive by its form, not by a name."""

    name = "user_bias"


def test_sdpa_dense_mask_takes_score_mods_with_a_linear_bias_form() -> None:
    a, cap = score_mods.Alibi(num_heads=2), score_mods.SoftCap(cap=5.0)
    assert routes._additive(a) and routes._additive(a >> a) and routes._additive(_UserBias(num_heads=2))
    assert not routes._additive(cap) and not routes._additive(a >> cap)
    (case,) = parse_config(_config(routes=["sdpa_dense_mask"], modes=["fwd"], seq_len=40))
    cpu = torch.device("cpu")
    x = routes.Inputs.make(case, "fwd", cpu)
    mask, score = masks.Causal(), _UserBias(num_heads=2)
    out = routes.prepare("sdpa_dense_mask", case, "fwd", mask, score, x, cpu).call()
    want = reference_attention(x.q, x.k, x.v, mask=mask, score_mod=score)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    with pytest.raises(routes.Unsupported, match="not an additive bias"):
        routes.prepare("sdpa_dense_mask", case, "fwd", mask, a >> cap, x, cpu)


def _config(**case: Any) -> dict[str, Any]:
    base = {"name": "c", "batch": 1, "heads": 2, "seq_len": 64, "head_dim": 16, "mask": {"name": "causal"}}
    return {
        "defaults": {"dtype": "fp32", "device": "cpu", "warmup": 0, "iters": 1},
        "cases": [{**base, **case}],
    }


def test_config_errors_name_the_valid_choices() -> None:
    with pytest.raises(ValueError, match="valid:.*routes"):
        parse_config(_config(rutes=["auto"]))
    with pytest.raises(ValueError, match="unknown 'flexx'.*flex"):
        parse_config(_config(routes=["flexx"]))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        parse_config(_config(kv_heads=3))
    with pytest.raises(ValueError, match="mask"):
        parse_config(_config(mask={"name": "causl"}))
    with pytest.raises(ValueError, match=r"goal must map fwd and/or fwdbwd"):
        parse_config(_config(goal={"forward": 1.0}))
    with pytest.raises(ValueError, match=r"goal.fwd must be a positive number"):
        parse_config(_config(goal={"fwd": -1}))
    assert parse_config(_config(goal={"fwdbwd": 5, "fwd": 7}))[0].goal == (("fwd", 7.0), ("fwdbwd", 5.0))
    h200 = load_config(H200)
    assert [c.name for c in h200] == [
        "causal",
        "alibi_causal",
        "softcap_causal",
        "document_causal",
        "prefix_lm",
        "causal_d64",
        "document_causal_d64",
        "causal_gqa",
        "document_causal_gqa",
        "sliding_32k",
        "chunked_32k",
        "gemma2_d256",
        "mla_d192",
        "phi3_d96",
        "decode_gqa",
    ]


def test_example_entries_join_a_familys_typical_example() -> None:
    (case,) = parse_config(_config(mask={"name": "causal"}, example=["tree", "alibi"], heads=2, kv_heads=2))
    mask, score = case.specs()
    tree = masks.Tree.typical_example(case.lq, case.seq_len, case.batch, case.heads)
    assert mask == masks.Causal() & tree
    assert isinstance(score, score_mods.Alibi)
    with pytest.raises(ValueError, match=r"example: unknown 'tre'.*Did you mean 'tree'"):
        parse_config(_config(example="tre"))
    # Every zoo row builds, and names a registered family.
    zoo = load_config("zoo")
    assert zoo and all(c.specs()[0] is not None or c.specs()[1] is not None for c in zoo)


def test_memory_guard_and_resume(tmp_path: Path) -> None:
    cases = parse_config(_config(routes=["sdpa_math", "sdpa_dense_mask"], max_dense_gib=1e-9, modes=["fwd"]))
    data: dict[str, Any] = {"env": {}, "rows": []}
    assert bench.run_sweep(cases, data, time_budget=-1.0, quiet=True) is False  # budget spent: no rows
    assert data["rows"] == []
    assert bench.run_sweep(cases, data, quiet=True) is True
    assert [r["status"] for r in data["rows"]] == ["OOM", "OOM"]
    assert all(r["reason"].startswith("skipped: estimated") for r in data["rows"])
    assert bench.run_sweep(cases, data, quiet=True) is True  # nothing left to run
    assert len(data["rows"]) == 2
    header, lines = summary(data["rows"])
    assert lines[0][header.index("sdpa_math")] == "OOM (skipped)"
    assert "## OOM and errors" in markdown(data)


def test_packaged_configs_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``flexattn-zoo bench h200``: the sweeps ship as package data; benchmarks/configs links there."""
    assert {"cpu_prefix", "h200", "smoke", "zoo"} <= set(packaged_configs())
    assert SMOKE.resolve().parent == (ROOT / "flexattn_zoo" / "bench" / "configs").resolve()
    monkeypatch.chdir(tmp_path)  # no checkout files in sight
    assert load_config("smoke") == load_config("smoke.yaml") == load_config(SMOKE)
    assert load_config("h200") == load_config(H200)
    with pytest.raises(
        ValueError, match=r"'smok' is neither a file nor a packaged config .*Did you mean 'smoke'"
    ):
        load_config("smok")
    with pytest.raises(ValueError, match="does not exist"):  # a path is a path, never a packaged name
        load_config("sub/smoke.yaml")
    # A file of that name wins over the packaged config.
    (tmp_path / "smoke.yaml").write_text(
        "cases: [{name: mine, batch: 1, heads: 1, seq_len: 8, head_dim: 8, mask: {name: causal}}]\n"
    )
    assert [c.name for c in load_config("smoke.yaml")] == ["mine"]
    assert [c.name for c in load_config("smoke")] != ["mine"]
    out = tmp_path / "r.json"
    args = ["bench", "smoke", "--cases", "causal", "--routes", "sdpa_math", "--modes", "fwd", "--quiet"]
    assert cli.main([*args, "--out", str(out)]) == 0
    assert [r["case"] for r in json.loads(out.read_text())["rows"]] == ["causal"]
    assert cli.main(["bench", "nope"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "neither a file nor a packaged config (cpu_prefix, generalization, h200, smoke, zoo)" in err


def test_cli_bench_delegates(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["bench", str(SMOKE), "--cases", "causal", "--routes", "sdpa_math", "--modes", "fwd", "--quiet"]
    assert cli.main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["route"], r["mode"], r["status"]) for r in rows] == [
        ("causal", "sdpa_math", "fwd", "ok")
    ]
    assert cli.main(["bench", str(SMOKE), "--cases", "nope", "--quiet"]) == 2
    # A resumed table names the earlier command with the commit it ran on.
    first = json.loads(out.read_text())
    first["env"].update(command="bench first", git="abc1234", previous_commands=["bench zeroth @ 0000000"])
    out.write_text(json.dumps(first))
    # --rerun replaces only the selected rows; the others are kept as they are.
    assert (
        cli.main(
            [
                *args[:4],
                "--modes",
                "fwd",
                "--routes",
                "sdpa_math,sdpa_flash",
                "--quiet",
                "--out",
                str(out),
                "--resume",
            ]
        )
        == 0
    )
    resumed = json.loads(out.read_text())
    assert resumed["env"]["previous_commands"] == ["bench zeroth @ 0000000", "bench first @ abc1234"]
    before = {r["route"]: r for r in resumed["rows"]}
    assert cli.main([*args, "--out", str(out), "--resume", "--rerun"]) == 0
    after = {r["route"]: r for r in json.loads(out.read_text())["rows"]}
    assert after.keys() == {"sdpa_math", "sdpa_flash"} and after["sdpa_flash"] == before["sdpa_flash"]
    assert after["sdpa_math"]["wall_s"] != before["sdpa_math"]["wall_s"]  # measured again
    assert cli.main([*args, "--out", str(out), "--rerun"]) == 2  # needs --resume
    # A rerun the time budget stops keeps the earlier rows it did not reach (it had dropped every
    # selected row before measuring).
    both = [*args[:4], "--modes", "fwd", "--routes", "sdpa_math,sdpa_flash", "--quiet", "--out", str(out)]
    assert cli.main([*both, "--resume", "--rerun", "--time-budget", "0"]) == 3
    kept = {r["route"]: r for r in json.loads(out.read_text())["rows"]}
    assert kept.keys() == {"sdpa_math", "sdpa_flash"}, kept.keys()
    assert kept["sdpa_flash"] == after["sdpa_flash"]


def test_png_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from flexattn_zoo.bench import report as bench_report

    monkeypatch.setattr(bench_report, "have_matplotlib", lambda: False)
    with pytest.raises(bench_report.MissingDependency, match="viz"):
        bench_report.write_pngs([], tmp_path / "x")
    assert bench.main([str(SMOKE), "--png", str(tmp_path / "x"), "--quiet"]) == 1  # before running anything


def test_summary_marks_host_bound_auto_below_the_best_route() -> None:
    def row(route: str, tflops: float, ms: float, host_ms: float | None) -> dict[str, Any]:
        return {
            "case": "c",
            "mode": "fwd",
            "route": route,
            "status": "ok",
            "tflops": tflops,
            "ms": ms,
            "host_ms": host_ms,
            "batch": 1,
            "heads": 1,
            "kv_heads": 1,
            "seq_len": 8,
            "head_dim": 8,
            "density": 1.0,
            "chosen": "flex" if route == "auto" else None,
        }

    def auto_vs_best(auto: dict[str, Any]) -> str:
        header, lines = summary([auto, row("flex", 314.0, 0.57, 0.39)])
        return lines[0][header.index("auto/best")]

    assert auto_vs_best(row("auto", 287.0, 0.63, 0.58)) == "0.91 (flex) -- below 0.97 (auto host-bound)"
    assert auto_vs_best(row("auto", 287.0, 0.63, 0.30)) == "0.91 (flex) -- below 0.97"
    assert (
        auto_vs_best(row("auto", 287.0, 0.63, None)) == "0.91 (flex) -- below 0.97"
    )  # CPU rows: no host time
    assert (
        auto_vs_best(row("auto", 310.0, 0.58, 0.58)) == "0.99 (flex)"
    )  # within the rule: nothing to explain


def test_decode_value_dim_and_padding_cases() -> None:
    """Cases with fewer queries than keys, a value head dim of their own, or padded keys run on
    the routes and baselines that take them; flops count q.k at D and p.v at Dv."""
    cases = parse_config(
        {
            "defaults": {"dtype": "fp32", "device": "cpu", "warmup": 0, "iters": 1, "modes": ["fwd"]},
            "cases": [
                {"name": "dec", "batch": 2, "heads": 4, "kv_heads": 2, "q_len": 1, "seq_len": 40,
                 "head_dim": 16, "routes": ["auto", "dense", "plain_sdpa"]},
                {"name": "mla", "batch": 1, "heads": 2, "seq_len": 24, "head_dim": 24, "v_head_dim": 8,
                 "mask": "causal", "routes": ["auto", "dense", "plain_sdpa"]},
                {"name": "pad", "batch": 3, "heads": 2, "seq_len": 32, "head_dim": 8,
                 "key_padding": {"min": 5, "max": 32}, "routes": ["auto", "dense", "sdpa_dense_mask"]},
            ],
        }
    )  # fmt: skip
    data: dict[str, Any] = {"env": {}, "rows": []}
    assert bench.run_sweep(cases, data, quiet=True) is True
    rows = {(r["case"], r["route"]): r for r in data["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), [r["reason"] for r in rows.values()]
    assert rows[("dec", "auto")]["q_len"] == 1 and rows[("dec", "auto")]["visible_pairs"] == 2 * 4 * 40
    mla = rows[("mla", "dense")]
    assert mla["flops"] == 2 * (24 + 8) * mla["visible_pairs"] and mla["v_head_dim"] == 8
    assert rows[("mla", "plain_sdpa")]["max_err"] < 1e-5
    assert rows[("pad", "auto")]["traits"] == [] and "dense" in rows[("pad", "auto")]["accepted"]
    assert rows[("pad", "sdpa_dense_mask")]["max_err"] < 1e-5


def test_fa4_direct_baseline_arguments() -> None:
    """The FA4-direct baseline passes FA4's ``window_size`` / ``softcap`` for what its own function
    expresses (whole rows, one window, approximate soft-cap) and refuses the rest by name."""
    cases = {
        c.name: c
        for c in parse_config(
            {
                "defaults": {"dtype": "bf16", "device": "cpu", "modes": ["fwd"]},
                "cases": [
                    {"name": "square", "batch": 2, "heads": 4, "seq_len": 256, "head_dim": 64},
                    {"name": "decode", "batch": 2, "heads": 4, "q_len": 1, "seq_len": 256, "head_dim": 64},
                ],
            }
        )
    }
    square, decode = cases["square"], cases["decode"]
    args = routes.fa4_direct_arguments
    assert args(square, None, None) == ((None, None), 0.0)
    assert args(decode, None, None) == ((None, None), 0.0)
    assert args(square, masks.Causal(), None) == ((None, 0), 0.0)
    gemma = masks.SlidingWindow(left=127, right=0) & masks.Causal()
    assert args(square, gemma, score_mods.SoftCap(cap=50.0, approx=True)) == ((127, 0), 50.0)
    assert args(square, masks.SlidingWindow(left=31, right=7), None) == ((31, 7), 0.0)
    refusals = [
        (square, None, score_mods.SoftCap(cap=50.0), "SoftCap(approx=True)"),
        (square, None, score_mods.Alibi(num_heads=4), "SoftCap(approx=True)"),
        (decode, masks.Causal(), None, "Lq == Lkv"),
        (square, masks.Document(doc_ids=torch.tensor([0] * 100 + [1] * 156)), None, "whole row"),
        (square, masks.Chunked(size=64), None, "whole row"),
    ]
    for case, mask, score, why in refusals:
        with pytest.raises(routes.Unsupported, match=re.escape(why)):
            args(case, mask, score)
    inputs = routes.Inputs.make(square, "fwd", torch.device("cpu"))
    with pytest.raises(routes.Unsupported, match="CUDA device"):
        routes.prepare_fa4_direct(square, masks.Causal(), None, inputs)


def test_auto_tuned_route_measures_from_an_empty_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto_tuned`` tunes the case's signature in the row's mode from an empty table (a fresh
    cache directory per row, not the caller's measurements nor an earlier row's) and times the
    route the table then gives."""
    from flexattn_zoo import tuning

    monkeypatch.delenv(tuning.store.CACHE_DIR_ENV, raising=False)
    timed: list[str] = []
    real = tuning.time_routes

    def counting(steps: dict[str, Any], *args: Any) -> Any:
        timed.extend(steps)
        return real(steps, *args)

    monkeypatch.setattr(tuning, "time_routes", counting)
    try:
        config = _config(routes=["auto", "auto_tuned"], modes=["fwd"], iters=2)
        config["cases"].append({**config["cases"][0], "name": "same_signature"})
        data: dict[str, Any] = {"env": {}, "rows": []}
        assert bench.run_sweep(parse_config(config), data, quiet=True) is True
        auto, tuned, _, tuned_again = data["rows"]
        assert tuned["route"] == tuned_again["route"] == "auto_tuned" and tuned["status"] == "ok", tuned
        # both rows measured (the second row's signature is the first's): twice the routes timed
        assert len(timed) >= 4 and timed[: len(timed) // 2] == timed[len(timed) // 2 :], timed
        fresh = os.environ[tuning.store.CACHE_DIR_ENV]
        assert Path(fresh).name.startswith("flexattn_zoo_bench_tune_")
        (note,) = [n for n in tuned_again["notes"] if n.startswith("tuning:")]
        ms = dict(re.findall(r"(\w+) (\d+\.\d+)", note.split("; ms ")[1]))
        assert len(ms) >= 2 and tuned_again["chosen"] in ms, note
        entries = tuning.table()
        assert len(entries) == 1 and next(iter(entries.values())).winner == tuned_again["chosen"]
        assert tuned["chosen"] in auto["accepted"]
        assert tuning.cache_path("cpu").is_relative_to(fresh)
    finally:
        tuning.clear()  # the measurement and its file (in the fresh directory)
        os.environ.pop(tuning.store.CACHE_DIR_ENV, None)


def test_timing_counts_are_minimums_filled_to_a_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short calls are timed over many repetitions (at least MIN_TIMED_S of them, at most
    MAX_ITERS), long ones keep the configured count; warm-up runs at least its count and
    MIN_WARMUP_S."""
    from flexattn_zoo.bench import timing

    assert timing.timed_iters(8, 1e-3) == int(timing.MIN_TIMED_S / 1e-3) + 1
    assert timing.timed_iters(8, 1e-7) == timing.MAX_ITERS
    assert timing.timed_iters(8, 1.0) == 8
    assert timing.timed_iters(2000, 1e-7) == 2000  # never below the configured count
    calls = []
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def step() -> None:  # each call takes 1 ms of the fake clock
        calls.append(1)
        clock[0] += 1e-3

    result = timing.measure(step, torch.device("cpu"), warmup=2, iters=3)
    warm = int(timing.MIN_WARMUP_S / 1e-3)
    timed = int(timing.MIN_TIMED_S / 1e-3) + 1
    assert abs(len(result.times_ms) - timed) <= 1 and result.median_ms == pytest.approx(1.0)  # float rounding
    # first call + warm-up batches (2, 4, 8, 16: the first total >= MIN_WARMUP_S) + timed calls
    assert warm <= len(calls) - 1 - len(result.times_ms) <= 2 * warm + 2


def test_host_affected_marks_rows_whose_host_time_is_half_their_time() -> None:
    """The re-timing trigger: a row's host time per call at least ``HOST_AFFECTED`` of its time
    (a row at 0.74, below the report's host-bound mark, is one); rows without a host time (CPU)
    or not run never trigger it."""
    share = bench.HOST_AFFECTED
    assert bench.host_affected({"status": "ok", "ms": 0.078, "host_ms": 0.058})
    assert bench.host_affected({"status": "ok", "ms": 1.0, "host_ms": share})
    assert not bench.host_affected({"status": "ok", "ms": 1.0, "host_ms": 0.99 * share})
    assert not bench.host_affected({"status": "ok", "ms": 1.0, "host_ms": None})
    assert not bench.host_affected({"status": "error", "ms": 1.0, "host_ms": 1.0})
    assert not bench.host_affected(None)


def test_rows_of_a_host_bound_case_are_timed_again_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host time drifts over a sweep process, so when a row of a case measured the host, the rows
    of that case and mode are timed again in interleaved rounds; each keeps its first median as
    ``ms_alone``. Rows of other cases (none host-bound) keep theirs, as does ``auto_tuned``."""
    limit = bench.INTERLEAVE_MAX_MS
    assert bench._may_interleave({"status": "ok", "route": "sdpa", "ms": limit})
    assert not bench._may_interleave({"status": "ok", "route": "sdpa", "ms": 1.01 * limit})
    assert not bench._may_interleave({"status": "ok", "route": "auto_tuned", "ms": 0.01})
    bound = {"a"}
    monkeypatch.setattr(bench, "host_affected", lambda row: row is not None and row["case"] in bound)
    # Every row short enough to be kept: on a loaded CPU (CI's two cores, another worker compiling)
    # a tiny call's median can pass the real limit, which this test is not about.
    monkeypatch.setattr(bench, "INTERLEAVE_MAX_MS", float("inf"))
    case = {"batch": 1, "heads": 2, "head_dim": 8, "seq_len": 32, "mask": {"name": "causal"}}
    config = {
        "defaults": {"dtype": "fp32", "device": "cpu", "warmup": 0, "iters": 2, "modes": ["fwd"]},
        "cases": [
            {"name": "a", "routes": ["sdpa_math", "sdpa_flash", "auto_tuned"], **case},
            {"name": "b", "routes": ["sdpa_math", "sdpa_flash"], **case},
        ],
    }
    data: dict[str, Any] = {"env": {}, "rows": []}
    assert bench.run_sweep(parse_config(config), data, quiet=True) is True
    rows = {(r["case"], r["route"]): r for r in data["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    for route in ("sdpa_math", "sdpa_flash"):
        again = rows[("a", route)]
        assert "ms_alone" in again, again["notes"]
        assert again["ms_alone"] > 0 and again["ms"] > 0 and again["ms"] != again["ms_alone"]
        assert any("interleaved" in note for note in again["notes"])
        assert "ms_alone" not in rows[("b", route)]
    assert "ms_alone" not in rows[("a", "auto_tuned")]


def test_each_case_runs_on_static_shape_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cases with one flex mask at two lengths: each compiles a static-shape graph (the
    runner forgets compiled graphs per case), as two one-case processes would; without that a
    later case could run Dynamo's dynamic-shape graph (symbolic sizes among its inputs). The
    library's entries keep their first shapes static (``STATIC_SHAPES``); at 0 here, the second
    length is the one an entry sends to its dynamic-shape graph."""
    from flexattn_zoo import _compat
    from flexattn_zoo import compile as compile_module
    from flexattn_zoo.compile import CACHE

    monkeypatch.setattr(compile_module, "STATIC_SHAPES", 0)

    dynamic: list[bool] = []
    real = _compat.inductor_backend

    def spying_backend() -> Any:
        backend = real()

        def compile_graph(gm: Any, example_inputs: Any) -> Any:
            dynamic.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
            return backend(gm, example_inputs)

        return compile_graph

    monkeypatch.setattr(_compat, "inductor_backend", spying_backend)
    case = {"batch": 1, "heads": 3, "head_dim": 8, "mask": {"name": "sliding_window", "left": 9}}
    config = {
        "defaults": {
            "dtype": "fp32",
            "device": "cpu",
            "warmup": 0,
            "iters": 1,
            "modes": ["fwd"],
            "routes": ["flex_cpu"],
        },
        "cases": [{"name": "a", "seq_len": 72, **case}, {"name": "b", "seq_len": 136, **case}],
    }
    for reset, expect_dynamic in ((True, False), (False, True)):
        CACHE.clear()
        torch.compiler.reset()
        dynamic.clear()
        if not reset:
            monkeypatch.setattr(bench, "fresh_compiles", lambda: None)
        data: dict[str, Any] = {"env": {}, "rows": []}
        assert bench.run_sweep(parse_config(config), data, quiet=True) is True
        assert [r["status"] for r in data["rows"]] == ["ok", "ok"], data["rows"]
        assert dynamic and any(dynamic) is expect_dynamic, (reset, dynamic)
