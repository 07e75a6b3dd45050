"""Hand-in: everything the handout asks students to attach, written into one folder.

    uv run python -m harness.tools.submissions.handin                      # fsdp.py, into handin/
    uv run python -m harness.tools.submissions.handin --impl my_fsdp.py --out handin/
    uv run python -m harness.tools.submissions.handin -- -m task1          # arguments after -- go to pytest

It writes
  points.json, test-output.txt   the points table of `pytest test.py` (and its whole output);
  <run>/<fsdp2|effdl>/traces/rank{r}.json, snapshots/rank{r}.pickle
                                 a profiled run of FSDP2 and of your FSDP: `tasks` (tasks 1-3,
                                 train.py's defaults) and each bonus you attempted (its test
                                 passed, or its TODO(bonusN) comment is gone from your file);
  <run>/overlap.png              FSDP2's schedule above yours, one step of rank 0 (harness/tools/traces/pictures.py);
  memory.png                     the peak memory per step of FSDP2 and of your FSDP in the memory tests;
  SUMMARY.md                     what is there, and every run that failed, with its error.
A run of your FSDP that fails (a TODO, a bug) is reported in SUMMARY.md; the rest still runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[3]  # the repository: harness/tools/submissions/handin.py

from harness.cli import parse  # noqa: E402
from harness.errors import BAD_INPUT, ConfigError, stop  # noqa: E402
from harness.tools.submissions import inert  # noqa: E402

BONUSES = ("bonus1", "bonus2", "bonus3")


@dataclass(frozen=True)
class Args:
    """Hand-in: everything the handout asks students to attach (the points table, profiled runs of
    FSDP2 and of your FSDP, SUMMARY.md), written into one folder. Arguments after `--` go to
    pytest, e.g. `-- -m task1`."""

    impl: str = "student"
    """the file effdl (the FSDP under test) imports: student (fsdp.py) or the path of a .py file."""
    out: Path = ROOT / "handin"
    """folder to write."""
    world_size: int = 2
    """ranks of the profiled runs."""
    runs: tuple[Literal["tasks", "bonus1", "bonus2", "bonus3"], ...] | None = None
    """only these profiled runs (default: tasks and every attempted bonus)."""
    tests: bool = True
    """run pytest test.py for the points table (--no-tests skips it)."""
    pytest_args: tyro.conf.Suppress[tuple[str, ...]] = ()


def run_tests(impl: str, out: Path, pytest_args: list[str]) -> tuple[dict | None, str]:
    """`pytest test.py --impl IMPL --points-json --artifacts`: the points rows (None if it wrote none),
    and what became of memory.png (copied into `out`)."""
    points = out / "points.json"
    (out / "memory.png").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as artifacts:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(ROOT / "test.py"), "--impl", impl,
               "--points-json", str(points), "--artifacts", artifacts, *pytest_args]
        print(f"running {' '.join(cmd[2:])} (a few minutes)", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (out / "test-output.txt").write_text(proc.stdout)
        said = Path(artifacts, "pictures.txt")
        memory = next((line for line in said.read_text().splitlines() if line.startswith("memory.png")), None) \
            if said.exists() else "memory.png: not drawn: pytest did not reach the end of its session"
        if Path(artifacts, "memory.png").exists():
            shutil.copy(Path(artifacts, "memory.png"), out / "memory.png")
            memory = "memory.png"
    return (json.loads(points.read_text()) if points.exists() else None), memory or "memory.png: not drawn"


def draw_overlap(out: Path, name: str, impl: str, failures: list[str]) -> str:
    """<run>/overlap.png from the run's traces; one line saying what was drawn."""
    from harness.tools.traces import pictures

    failed = {who: next((f.split(": ", 1)[1] for f in failures if f.startswith(f"{name}, {who}: ")), None)
              for who in ("fsdp2", "effdl")}  # then its folder holds no trace of this hand-in, or an older one
    traces = [None if failed[who] else out / name / who / "traces" for who in ("fsdp2", "effdl")]
    (out / name / "overlap.png").unlink(missing_ok=True)  # an earlier hand-in's
    try:
        pictures.overlap_png(*traces, out / name / "overlap.png", title=f"Overlap, {name}: FSDP2 and {impl}",
                             notes={who: f"the run failed: {f}" for who, f in failed.items() if f})
        return f"{name}/overlap.png"
    except Exception as e:  # a picture must not cost the rest of the hand-in
        return f"{name}/overlap.png not drawn: {type(e).__name__}: {e}"


def attempted_bonuses(impl_file: Path, points: dict | None) -> list[str]:
    """A bonus is attempted when its points were earned or its TODO comment is gone."""
    earned = {r["task"].replace(" ", ""): r["earned"] for r in (points or {}).get("rows", [])}
    source = impl_file.read_text()
    return [b for b in BONUSES if earned.get(b) or f"TODO({b})" not in source]


def profile_runs(impl: str, out: Path, runs: list[str], world_size: int) -> list[str]:
    """Profiled runs of FSDP2 and of effdl; the failures, one line each."""
    from harness.tools.grading import jobs, policy
    from harness.tools.grading.ranks import RankError, RankPool

    failures = []
    with RankPool(world_size, role="own") as pool:
        for name in runs:
            flags = {} if name == "tasks" else policy.MODES[name].flags
            cfg = policy.config(impl, num_steps=3, profile_steps=2, **flags)
            for who, c in (("fsdp2", policy.as_fsdp2(cfg)), ("effdl", cfg)):
                folder = out / name / who
                c = dataclasses.replace(c, traces_dir=folder / "traces", snapshots_dir=folder / "snapshots")
                print(f"profiling {name} with {'FSDP2' if who == 'fsdp2' else impl}", flush=True)
                try:
                    pool.run(jobs.train_job, c, False, timeout=600)  # the trace as the program runs
                except RankError as e:
                    lines = [line for line in str(e).splitlines() if line.strip()]
                    error = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "?")
                    error = re.sub(r"^[\w.]+\.(\w+: )", r"\1", error.strip())  # the type without its module
                    failures.append(f"{name}, {who}: {error[:300]}")
    return failures


def summary(impl_file: Path, tested: bool, points: dict | None, bonuses: list[str], runs: list[str],
            drawn: list[str], memory: str, failures: list[str]) -> str:
    """SUMMARY.md. Its file name, the tests' evidence and the runs' errors are the submission's text
    (its exception messages): shown as text, so the page a grader opens renders none of it."""
    md = inert.markdown_text
    lines = [f"# Hand-in of {md(impl_file)}", ""]
    if points is None:
        lines += ["No points table: " + ("--no-tests." if not tested else "pytest wrote none (see test-output.txt)."), ""]
    else:
        lines += ["| task | points | evidence |", "|---|---|---|"]
        lines += [f"| {r['task']} | {'-' if r['earned'] is None else r['earned']} / {r['max']} | {md(r['evidence'])} |"
                  for r in points["rows"]]
        graded = [r for r in points["rows"] if r["earned"] is not None]
        lines += [f"| total | {sum(r['earned'] for r in graded)} / {sum(r['max'] for r in graded)} | |", ""]
    lines += [f"Bonuses attempted: {', '.join(bonuses) or 'none'}.", "",
              "Profiled runs (traces/rank{r}.json for Perfetto, snapshots/rank{r}.pickle for "
              "`python -m torch.cuda._memory_viz trace_plot`):", ""]
    lines += [f"- {name}/fsdp2 and {name}/effdl" for name in runs]
    lines += ["", "Pictures (FSDP2 above yours; memory from the memory tests):", ""]
    lines += [f"- {md(d)}" for d in drawn] + [f"- {md(memory)}"]
    if failures:
        lines += ["", "Runs that failed:", ""] + [f"- {md(f)}" for f in failures]
    return "\n".join(lines) + "\n"


def main(args: Args) -> None:
    from harness.impl import impl_path

    try:
        impl_file = impl_path(args.impl)
    except ConfigError as e:  # it says what is wrong with the name and how to fix it
        stop(str(e), BAD_INPUT)
    impl = "student" if args.impl == "student" else str(impl_file.resolve())
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    points, memory = run_tests(impl, out, list(args.pytest_args)) if args.tests else (None, "memory.png: not drawn: --no-tests")
    bonuses = attempted_bonuses(impl_file, points)
    runs = args.runs or ["tasks", *bonuses]
    failures = profile_runs(impl, out, runs, args.world_size)
    drawn = [draw_overlap(out, name, impl_file.name, failures) for name in runs]

    (out / "SUMMARY.md").write_text(summary(impl_file, args.tests, points, bonuses, runs, drawn, memory, failures))
    print(f"wrote {out} ({len(failures)} failed run(s); see {out / 'SUMMARY.md'})")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.submissions.handin"))


if __name__ == "__main__":
    cli()
