"""Mutants: the reference with snippets replaced, shared by every mutant test file."""

from pathlib import Path

from solution import make_skeleton


def write_mutant(folder: Path, name: str, changes: list[tuple[str, str]]) -> str:
    """Write solution/fsdp.py with each (snippet, replacement) applied as FOLDER/NAME.py; every
    snippet must occur exactly once (a mutant that silently stops mutating would prove nothing)."""
    text = make_skeleton.SOLUTION.read_text()
    for old, new in changes:
        assert text.count(old) == 1, f"mutant {name}: its snippet is no longer in solution/fsdp.py once"
        text = text.replace(old, new)
    path = folder / f"{name}.py"
    path.write_text(text)
    return str(path)
