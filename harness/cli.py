"""The command line of every `python -m` tool, parsed as train.py parses its own: a frozen
dataclass of flags with docstring help, read by tyro.

Flags several tools share keep one name and meaning everywhere: `--impl` (the file effdl imports
under test: student, i.e. fsdp.py, or the path of a .py file), `--out` (the file or folder
written), `--device {auto,cpu,cuda}` (auto: CUDA when there is a GPU per rank, as train.py),
`--world-size` (ranks). Errors end through harness.errors.stop.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def parse(args_type: type[T], argv: Sequence[str] | None = None, *, prog: str) -> T:
    """tyro.cli(args_type) on argv (default: sys.argv[1:]); prog: the command as the help shows it
    (`python -m harness.tools.submissions.grade`, not the file's path, which is what `python -m` would show).

    A dataclass with a `pytest_args` field (suppressed from the flags) gets everything after the
    first `--` there, unparsed: tyro would otherwise read `-k expr` as its own flags."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = "pytest_args" in {f.name for f in dataclasses.fields(args_type)}
    if not passthrough or "--" not in argv:
        return tyro.cli(args_type, args=argv, prog=prog)
    cut = argv.index("--")
    return dataclasses.replace(tyro.cli(args_type, args=argv[:cut], prog=prog), pytest_args=tuple(argv[cut + 1:]))
