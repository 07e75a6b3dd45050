"""The grading and measuring tools above the runtime (harness/): they import train.py; nothing below
imports them. Four packages, each run as `uv run python -m harness.tools.<package>.<tool>`:

  grading/      the checks behind test.py, the rank pools they run on, and what keeps them honest
  traces/       reading a run's chrome traces: collectives, overlap, memory, and their pictures
  lab/          the writeup's measurements: the report, the benchmark, the initialisation peak
  submissions/  what graders and students run on a hand-in: points, grade, handin, similarity, Gradescope

Importing this package imports nothing.
"""
