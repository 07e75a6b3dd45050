"""What students run but never edit. This package is the runtime train.py stands on (data, model,
process groups, platform, memory, profiling); harness/tools/ holds the grading and measuring tools above it.

Tools run as modules from the repository root, e.g. `uv run python -m harness.tools.lab.benchmark`.
Importing the package imports nothing else except `compat`, whose `install()` must run before
torchtitan is imported anywhere (it stands in for a triton module where triton is absent).
"""

from harness import compat as _compat

_compat.install()
