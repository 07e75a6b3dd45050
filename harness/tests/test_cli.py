"""Every command: its --help works, and the flags commands share have one name and meaning.

The help is read in this process (runpy runs each module as `python -m` would), so the check
costs no interpreter start and no second torch import per command."""

from __future__ import annotations

import re
import runpy
import sys
import warnings

import pytest

from harness import cli
from harness.errors import BAD_INPUT

# module -> whether it takes the FSDP under test (then as --impl)
TOOLS = {
    "train": True,
    "harness.tools.traces.analysis": False,
    "harness.assets": False,
    "harness.tools.lab.benchmark": True,
    "harness.tools.submissions.grade": False,  # its submissions are many files: a positional folder, not --impl
    "harness.tools.submissions.handin": True,
    "harness.tools.submissions.gradescope": False,  # Gradescope's submission: a fixed place, not --impl
    "harness.tools.submissions.points": False,  # a points table already written, not a file under test
    "harness.tools.lab.init_memory": True,
    "harness.tools.traces.pictures": False,
    "harness.tools.lab.report": True,
    "harness.tools.submissions.similarity": False,  # a folder of submissions, as grade
}
# names the shared flags replaced: each must not come back
RETIRED = {"--output", "--world"}


def tool_help(module: str, monkeypatch, capsys) -> str:
    """`python -m MODULE --help`, run here: its text (a wide terminal, so no flag wraps)."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported already)
        # alter_sys: the module is __main__ while it runs, where its dataclass annotations resolve
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    return out


def assert_shared_flags(module: str, text: str, takes_impl: bool) -> None:
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert f"python -m {module}" in text or module in ("train", "harness.tools.lab.init_memory"), text[:300]
    assert not flags & RETIRED, f"{module} still names {flags & RETIRED}"
    # one-letter aliases only where every command has them: -h alone
    shorts = set(re.findall(r"^\W*(-[A-Za-z]),? --", text, re.M))
    assert shorts <= {"-h"}, f"{module} has one-letter aliases {shorts - {'-h'}}"
    assert ("--impl" in flags) == takes_impl, f"{module}: the FSDP under test is --impl where a command takes one"
    if "--device" in flags:
        options = text.split("\n\n", 1)[1]  # past the usage line
        row = re.search(r"--device \{([a-z,]+)\}.*?\(default: (\w+)\)", options, re.S)
        assert row and row[1].split(",") == ["auto", "cpu", "cuda"], f"{module}: --device {{auto,cpu,cuda}}"
        assert row[2] == "auto", f"{module}: --device is auto by default, as train.py's"


@pytest.mark.parametrize("module", list(TOOLS))
def test_help_uses_the_shared_flags(module, monkeypatch, capsys):
    assert_shared_flags(module, tool_help(module, monkeypatch, capsys), TOOLS[module])


def test_arguments_after_a_double_dash_go_to_pytest(tmp_path):
    from harness.tools.submissions import grade, handin

    args = cli.parse(grade.Args, [str(tmp_path), "--out", "p.csv", "--", "-k", "forward", "--", "-x"], prog="grade")
    assert args.pytest_args == ("-k", "forward", "--", "-x") and str(args.out) == "p.csv"
    assert cli.parse(handin.Args, ["--world-size", "3"], prog="handin").pytest_args == ()


def test_bad_input_stops_with_one_error_line(tmp_path, capsys):
    from harness.tools.submissions import grade

    with pytest.raises(SystemExit) as e:
        grade.cli([str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert e.value.code == BAD_INPUT and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("gpus, flag, world, device", [
    (0, "auto", 2, "cpu"), (1, "auto", 2, "cpu"), (2, "auto", 2, "cuda"), (8, "auto", 4, "cuda"),
    (0, "cpu", 2, "cpu"), (8, "cpu", 2, "cpu"), (1, "cuda", 1, "cuda"), (0, "cuda", 1, None), (2, "cuda", 4, None),
])
def test_pool_device_is_auto_as_train_py(monkeypatch, gpus, flag, world, device):
    """--device of the tools that start their own ranks: auto is CUDA only with a GPU per rank."""
    import torch

    from harness.distributed import pool_device
    from harness.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if device is None:
        with pytest.raises(ConfigError, match="--device cuda needs one GPU per rank"):
            pool_device(flag, world)
    else:
        assert pool_device(flag, world) == device
