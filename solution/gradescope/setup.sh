#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu with python3):
# uv, the locked environment, the data and tokenizer the tests train on, and FSDP2's side of every
# graded check (harness/tools/grading/fsdp2_cache.py), which is the same for every submission.
set -euo pipefail
cd "$(dirname "$0")/repository"
export PATH="/usr/local/bin:$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null 2>&1; then
  # pip where the system Python allows it, else uv's own installer
  python3 -m pip install --quiet uv 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages uv 2>/dev/null \
    || curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin sh
fi
# Bytecode written now: every submission runs in a fresh copy of the image, where each process
# (pytest, every rank) would otherwise compile torch's sources again (seconds each).
uv sync --frozen --compile-bytecode
uv run --frozen python -m harness.assets
# The submission's rank processes run as this unprivileged user (harness/tools/grading/sandbox.py): they can
# read the code and data, but not FSDP2's stored side and its secret, nor write the repository or
# /autograder/results.
id -u fsdp-sandbox >/dev/null 2>&1 || useradd --system --user-group --no-create-home --home-dir /nonexistent \
  --shell /usr/sbin/nologin fsdp-sandbox
# The skeleton's graded run trains FSDP2 in every case before stopping at its TODOs, so each
# submission then trains only itself. The entries are keyed by the CPU, threads and versions among
# the rest: where Gradescope runs submissions on other hardware than it built on, FSDP2 trains again.
uv run --frozen pytest test.py -q -p no:cacheprovider 2>&1 | tail -n 1 || true
