"""Errors the harness reports to a person, each saying what is wrong and how to fix it.

Every command (train.py and each `python -m` tool) ends on an error the same way: `stop()`.
"""

from typing import NoReturn


class ConfigError(ValueError):
    """A flag combination that cannot run; the message says which and how to fix it."""


# stop()'s exit codes, as argparse and tyro use them: 2 when what was asked cannot be done as
# given (a flag, a path), 1 when it was tried and failed.
BAD_INPUT = 2
FAILED = 1


def stop(message: str, exit_code: int = FAILED) -> NoReturn:
    """Print `message` as one `error:` line on stderr and exit with `exit_code` (BAD_INPUT or
    FAILED), leaving no traceback.

    Under torchrun every rank reaches here alike; only rank 0 prints. torchrun always ends a
    failed run with its own summary (it cannot be turned off short of exiting 0, which would
    lie to scripts), so the message is also written to the error file torchrun reads
    (TORCHELASTIC_ERROR_FILE): the summary's "Root Cause" then ends with this message instead
    of a link to torchrun's docs.
    """
    import json
    import os
    import sys
    import time

    line = f"error: {message}"
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    sys.exit(exit_code)
