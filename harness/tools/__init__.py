"""The grading and measuring tools above the runtime (harness/): they import train.py; nothing below
imports them. Four packages, each run as `uv run python -m harness.tools.<package>.<tool>`:

  grading/      the checks behind test.py, the rank pools they run on, and what keeps them honest
  traces/       reading a run's chrome traces: collectives, overlap, memory, and their pictures
  lab/          the writeup's measurements: the report, the benchmark, the initialisation peak
  submissions/  what graders and students run on a hand-in: points, grade, handin, similarity, Gradescope

Importing this package imports nothing. MOVED is the table of the commands that used to be
`harness.tools.<tool>`, before the tools were split into these packages (docs/grading.md, "Commands moved").
"""

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
