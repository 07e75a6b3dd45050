"""The grading and measuring tools above the runtime (harness/): they import train.py; nothing below
imports them. Four packages, each run as `uv run python -m harness.tools.<package>.<tool>`:

  grading/      the checks behind test.py, the rank pools they run on, and what keeps them honest
  traces/       reading a run's chrome traces: collectives, overlap, memory, and their pictures
  lab/          the writeup's measurements: the report, the benchmark, the initialisation peak
  submissions/  what graders and students run on a hand-in: points, grade, handin, similarity, Gradescope

MOVED is the table of the commands that used to be `harness.tools.<tool>`, before the tools were split
into these packages (docs/grading.md, "Commands moved"): such an old command still runs nothing, but
says where it went (`python -m harness.tools.grade` ends with "harness.tools.grade moved to
harness.tools.submissions.grade: run `python -m harness.tools.submissions.grade`").
"""

import importlib.abc
import sys

MOVED = {
    "harness.tools.analysis": "harness.tools.traces.analysis",
    "harness.tools.benchmark": "harness.tools.lab.benchmark",
    "harness.tools.grade": "harness.tools.submissions.grade",
    "harness.tools.gradescope": "harness.tools.submissions.gradescope",
    "harness.tools.handin": "harness.tools.submissions.handin",
    "harness.tools.init_memory": "harness.tools.lab.init_memory",
    "harness.tools.pictures": "harness.tools.traces.pictures",
    "harness.tools.points": "harness.tools.submissions.points",
    "harness.tools.report": "harness.tools.lab.report",
    "harness.tools.similarity": "harness.tools.submissions.similarity",
}
"""Old command (`python -m` module) -> where it is now."""


class _MovedCommands(importlib.abc.MetaPathFinder):
    """Asked last, for a module no other finder found: an old command's says where it went."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} moved to {MOVED[name]}: run `python -m {MOVED[name]}`", name=name)
        return None


if not any(isinstance(f, _MovedCommands) for f in sys.meta_path):
    sys.meta_path.append(_MovedCommands())
