"""The ``flexattn-zoo`` CLI, called in-process through ``cli.main(argv)`` (and once as a module)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexattn_zoo.cli import app as cli
from flexattn_zoo.registry import MASKS, SCORES


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def picture(out: str) -> list[str]:
    """The lines of a text picture in ``out`` (only '#', '+', '.')."""
    return [line for line in out.splitlines() if line and set(line) <= set("#+.")]


# ---------------------------------------------------------------------------------------------
# list


def test_list_all_names_every_registered_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list")
    assert code == 0
    for name in MASKS.names() + SCORES.names():
        assert name in out
    assert "left, right=0" in out  # parameters with their defaults


def test_list_one_kind(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list", "masks")
    assert code == 0
    assert "sliding_window" in out
    assert "softcap" not in out
    code, out, _ = run(capsys, "list", "score_mods")
    assert code == 0 and "alibi" in out and "sliding_window" not in out


# ---------------------------------------------------------------------------------------------
# show


def test_show_causal_picture_and_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "causal", "--len", "6")
    assert code == 0
    assert picture(out) == ["#.....", "##....", "###...", "####..", "#####.", "######"]
    assert "visible: 21 of 36" in out
    assert "1 block: 0 full, 1 partial, 0 empty" in out


def test_show_counts_the_visible_positions_of_the_row_it_draws(capsys: pytest.CaptureFixture[str]) -> None:
    """A per-row mask with --batch 2 draws batch row 0: its count is out of that row's positions
    (5 of 9), not of both rows' (it said 5 of 18)."""
    code, out, _ = run(capsys, "show", "document", "--doc-ids", "0,0,1;0,1,1", "--len", "3", "--batch", "2")
    assert code == 0 and picture(out) == ["##.", "##.", "..#"]
    assert "visible: 5 of 9 positions in batch row 0 (55.6%)" in out


def test_show_names_what_a_score_picture_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """A softmax score mod's picture is a bias; activation attention's (sigmoid) is the log-weight
    its score mod returns, which is not a bias on any softmax score."""
    code, out, _ = run(capsys, "show", "alibi", "--len", "4", "--heads", "2")
    assert code == 0 and "bias added to a zero score" in out
    code, out, _ = run(capsys, "show", "sigmoid", "--len", "4")
    assert code == 0 and "log-weight of a zero score" in out and "bias added" not in out


def test_show_generic_params_including_negative_looking_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "sliding_window", "--len", "5", "--left", "1", "--right=1")
    assert code == 0
    assert picture(out) == ["##...", "###..", ".###.", "..###", "...##"]


def test_show_kv_len_and_string_param(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "causal", "--align", "bottom_right", "--len", "2", "--kv-len", "4")
    assert code == 0
    assert picture(out) == ["###.", "####"]


def test_show_constructor_param_and_list_value(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "document", "--lengths", "3,2,1", "--len", "6")
    assert code == 0
    assert picture(out) == ["###...", "###...", "###...", "...##.", "...##.", ".....#"]
    code, out2, _ = run(capsys, "show", "document", "--doc-ids", "0,0,0,1,1,2", "--len", "6")
    assert code == 0 and picture(out2) == picture(out)


def test_show_combination(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "causal+chunked", "--size", "2", "--len", "4")
    assert code == 0
    assert picture(out) == ["#...", "##..", "..#.", "..##"]
    code, out, _ = run(capsys, "show", "causal+chunked", "--chunked.size", "2", "--len", "4")
    assert code == 0 and picture(out)[2] == "..#."


def test_show_downsamples_long_masks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "sliding_window", "--left", "100", "--len", "1000")
    assert code == 0
    assert "downsampled" in out
    lines = picture(out)
    assert 0 < len(lines) <= 64 + 8  # mask picture (<= 64 rows) plus the block picture (8 rows)
    assert all(len(line) <= 64 for line in lines)
    assert "64 blocks" in out  # ceil(1000 / 128) ** 2


def test_show_sampled_for_huge_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "causal", "--len", "20000")
    assert code == 0
    assert "sampled" in out
    lines = picture(out)
    assert lines[0].startswith("+.") and all(len(line) <= 64 for line in lines)


def test_show_score_mod_bias(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "alibi", "--len", "4", "--heads", "8")
    assert code == 0
    assert "-0.50" in out and "head 0 of 8" in out  # slope of head 0 of 8 is 1/2
    code, out, _ = run(capsys, "show", "softcap", "--cap", "5", "--len", "4")
    assert code == 0
    assert "no position-dependent bias" in out
    assert "4.82" in out  # 5 * tanh(10 / 5)


def test_show_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "mask.png"
    code, _, err = run(capsys, "show", "causal", "--len", "8", "--png", str(target))
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 1
        assert "pip install 'flexattn-zoo[viz]'" in err
        assert "Traceback" not in err
        assert not target.exists()
    else:
        assert code == 0
        assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# errors: exit code 2, the message, no traceback


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show", "slidng_window", "--len", "4"], "Did you mean 'sliding_window'"),
        (["show", "sliding_window", "--lft", "3", "--len", "4"], "Did you mean --left"),
        (["show", "sliding_window", "--len", "4"], "needs parameter(s): left"),
        (["show", "chunked", "--size", "-1", "--len", "4"], "size"),
        (["show", "causal", "--align", "middle", "--len", "4"], "align"),
        (["plan", "--mask", "nope", "--len", "8", "--arch", "sm90"], "unknown mask 'nope'"),
        (["plan", "--mask", "causal", "--len", "8", "--arch", "h100"], "arch"),
        # The specs are validated against the problem, as fz.plan does.
        (
            ["plan", "--score", "alibi", "--num-heads", "3", "--heads", "4", "--len", "8", "--arch", "cpu"],
            "heads",
        ),
        (
            [
                "plan",
                "--mask",
                "prefix_lm",
                "--prefix-len",
                "1,2,3",
                "--batch",
                "2",
                "--len",
                "8",
                "--arch",
                "cpu",
            ],
            "batch",
        ),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in " ".join(err.split())  # rich may wrap long messages
    assert "Traceback" not in err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "show", "causal")  # --len missing
    assert code == 2 and "--len" in err
    code, _, _ = run(capsys, "list", "everything")
    assert code == 2


def test_module_entry_point_exit_code() -> None:
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, "-m", "flexattn_zoo", "show", "no_such_mask", "--len", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown mask or score_mod 'no_such_mask'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# env and plan


@pytest.mark.parametrize("installed", ["9.9.9", None])
def test_version_is_the_running_codes(
    installed: str | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another version installed (a checkout on PYTHONPATH beside a wheel), or none at all: the
    # version printed is the code's, as env prints it.
    import importlib.metadata

    import flexattn_zoo

    def installed_version(name: str) -> str:
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", installed_version)
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.split() == ["flexattn-zoo", flexattn_zoo.__version__]


def test_env_lists_versions_and_routes(capsys: pytest.CaptureFixture[str]) -> None:
    from flexattn_zoo.backends import BACKENDS

    code, out, _ = run(capsys, "env")
    assert code == 0
    assert torch.__version__ in out
    assert "detected arch" in out
    for backend in BACKENDS:
        assert backend.name in out


def test_plan_on_sm90_from_a_cpu_machine(capsys: pytest.CaptureFixture[str]) -> None:
    from flexattn_zoo import masks
    from flexattn_zoo.dispatch import Problem, plan_problem

    argv = [
        "plan",
        "--mask",
        "sliding_window",
        "--left",
        "1023",
        "--len",
        "32768",
        "--heads",
        "16,4",
        "--dim",
        "128",
        "--dtype",
        "bf16",
        "--arch",
        "sm90",
        "--grad",
    ]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    expected = plan_problem(
        Problem(
            batch=1,
            heads=16,
            kv_heads=4,
            q_len=32768,
            kv_len=32768,
            head_dim=128,
            dtype=torch.bfloat16,
            device_type="cuda",
            arch="sm90",
            requires_grad=True,
            mask=masks.SlidingWindow(left=1023),
            score=None,
        )
    )
    assert f"route: {expected.backend}" in out
    for cand in expected.candidates:
        assert cand.name in out
    assert "chosen" in out and "refused" in out
    assert expected.explain() in out  # the CLI prints what fz.plan(...).explain() says


def test_plan_score_mod_takes_num_heads_from_heads(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--mask",
        "causal",
        "--score",
        "alibi",
        "--score",
        "softcap",
        "--cap",
        "30",
        "--len",
        "1000",
        "--heads",
        "12",
        "--dim",
        "64",
        "--dtype",
        "fp32",
        "--arch",
        "cpu",
    )
    assert code == 0
    assert "alibi(num_heads=12) >> softcap(cap=30.0)" in " ".join(out.split())


def test_plan_from_yaml_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("flexattn_zoo.config")
    config = tmp_path / "attn.yaml"
    config.write_text("mask: {name: sliding_window, left: 127}\nscore_mod: {name: softcap, cap: 30}\n")
    code, out, _ = run(capsys, "plan", "--config", str(config), "--len", "512", "--arch", "sm90")
    assert code == 0
    assert "sliding_window(left=127)" in out and "softcap(cap=30.0)" in out


# ---------------------------------------------------------------------------------------------
# demo


def test_demo_tiny_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    # Two presets (one SDPA route, one compiled flex route) at L=64 keep this well under a minute.
    code, out, _ = run(
        capsys,
        "demo",
        "--device",
        "cpu",
        "--len",
        "64",
        "--repeats",
        "1",
        "--only",
        "full",
        "--only",
        "sliding_window(left=8)",  # not "sliding_window": dilated_sliding_window contains it
    )
    assert code == 0, out
    assert "full" in out and "sliding_window(left=8)" in out
    assert out.count("PASS") == 2 and "FAIL" not in out
    assert "demo: 2 of 2 presets" in out


def test_demo_no_matching_preset_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--device", "cpu", "--only", "no-such-preset")
    assert code == 2 and "no preset matches" in err


def test_demo_presets_cover_the_registry() -> None:
    from flexattn_zoo.cli import demo

    names = [p.name for p in demo.demo_cases(256, 1, 2)]
    for name in MASKS.names():
        assert any(n == name or n.startswith(f"{name}(") for n in names), name
    for name in SCORES.names():
        assert any(n.startswith(f"causal + {name}") for n in names), name
    assert any(n.startswith("causal & document(") for n in names)
    assert any(n.startswith("causal & chunked(") for n in names)


@pytest.mark.slow
def test_demo_defaults_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--device", "cpu")
    assert code == 0, out
    assert "FAIL" not in out


@pytest.mark.gpu
def test_demo_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code, out, _ = run(capsys, "demo", "--device", "cuda", "--len", "1024", "--repeats", "3")
    assert code == 0, out
    assert "FAIL" not in out


def test_import_option_loads_user_specs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cli_user_masks.py").write_text(
        "from flexattn_zoo import masks\n"
        "masks.register_function('cli_even_keys', lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code, out, _ = run(capsys, "--import", "cli_user_masks", "show", "causal+cli_even_keys", "--len", "4")
        assert code == 0
        assert out.splitlines()[0] == "causal & cli_even_keys"
        assert picture(out) == ["#...", "#...", "#.#.", "#.#."]
    finally:
        if "cli_even_keys" in MASKS:
            MASKS.unregister("cli_even_keys")
        sys.modules.pop("cli_user_masks", None)
    code, _, err = run(capsys, "--import", "no_such_module_here", "list")
    assert code == 2 and "no_such_module_here" in err


# ---------------------------------------------------------------------------------------------
# what a new user runs into


def test_import_finds_modules_in_the_current_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The console script's sys.path[0] is its bin/ folder, not the current directory.
    (tmp_path / "cwd_masks_plugin.py").write_text(
        "from flexattn_zoo import masks\n"
        "masks.register_function('cwd_plugin_mask', lambda b, h, q, kv: q >= kv)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    try:
        code, out, err = run(capsys, "--import", "cwd_masks_plugin", "list", "masks")
        assert code == 0, err
        assert "cwd_plugin_mask" in out
    finally:
        MASKS.unregister("cwd_plugin_mask")
        sys.modules.pop("cwd_masks_plugin", None)


@pytest.mark.parametrize("module", ["", ".relative"])
def test_import_of_an_empty_or_relative_name_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], module: str
) -> None:
    code, _, err = run(capsys, "--import", module, "list")
    assert code == 2
    assert "--import" in err and "absolute module name" in err
    assert "Traceback" not in err


def test_list_fits_an_80_column_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    # One line per entry, plus a title and a header per section and one closing hint.
    entries = len(MASKS.names()) + len(SCORES.names()) + len(fz_presets_names())
    assert len(lines) == entries + 3 * 2 + 1
    for name in (*MASKS.names(), *SCORES.names()):
        assert any(line.startswith(name + " ") for line in lines), name


def test_list_long_shows_full_descriptions(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "list", "--long")
    assert code == 0
    summary = MASKS.entry("causal").summary.replace("``", "")
    assert " ".join(summary.split()) in " ".join(out.replace("│", " ").split())


def fz_presets_names() -> list[str]:
    from flexattn_zoo.models import presets

    return presets.names()


# ---------------------------------------------------------------------------------------------
# bench and tune output files


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "smoke", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
        (["bench", "smoke", "--md", "{tmp}/no dir/r.md"], "--md '{tmp}/no dir/r.md': folder"),
        (["bench", "smoke", "--out", "{tmp}/no dir/r.json"], "--out '{tmp}/no dir/r.json': folder"),
        (["bench", "smoke", "--report-only", "--out", "{tmp}/gone.json"], "--out results file"),
        (["tune", "smoke", "--out", "{tmp}/no dir/t.md"], "--out '{tmp}/no dir/t.md': folder"),
        (["tune", "smoke", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
    ],
)
def test_a_bad_output_path_is_refused_before_any_work(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused up front, naming the option (a sweep is not lost at its end to a typo in a path).
    code, out, err = run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 2
    assert message.format(tmp=tmp_path) in " ".join(err.split())
    assert "Traceback" not in err and out == ""


def test_bench_a_report_that_cannot_be_written_exits_1_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexattn_zoo.bench import runner

    def disk_full(*args: object, **kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "markdown", disk_full)
    results = tmp_path / "r.json"
    results.write_text('{"env": {}, "rows": []}')
    code, _, err = run(
        capsys, "bench", "smoke", "--report-only", "--out", str(results), "--md", str(tmp_path / "r.md")
    )
    assert code == 1
    assert "No space left on device" in err and "Traceback" not in err
