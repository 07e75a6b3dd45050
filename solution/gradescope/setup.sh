#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu with python3):
# uv, the locked environment, and the data and tokenizer the tests train on. Nothing else is warmed:
# every submission's run starts from this image as any student's machine would.
set -euo pipefail
cd "$(dirname "$0")/repository"
export PATH="/usr/local/bin:$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null 2>&1; then
  # pip where the system Python allows it, else uv's own installer
  python3 -m pip install --quiet uv 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages uv 2>/dev/null \
    || curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin sh
fi
uv sync --frozen
uv run --frozen python -m harness.assets
