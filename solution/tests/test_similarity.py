"""harness.tools.submissions.similarity on the reference: a renamed, re-spaced copy of it is flagged; the reference
and an independently written correct solution of the same TODOs (variant_fsdp.py) are not, against
each other nor against FSDP2.

variant_fsdp.py is the skeleton with every task1, task2 and task3 TODO filled anew (the bonuses keep
their stand-ins): its own helpers (`_allocate_full`, `RootContext.flush_reduce`), split/narrow/cat where
the reference slices, a concatenated send buffer for the all-gather, a zeroed and unflattened gradient
layout, forward prefetch from a successor map, backward prefetch by scanning what forward finished.
It passes test.py's task1 (world sizes 2 and 3), task2 and task3:

    uv run pytest test.py -m "task1 or task2 or task3" --impl solution/tests/variant_fsdp.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.tests.test_similarity import fsdp2_pasted, rename, score
from harness.tools.submissions import similarity
from harness.tools.submissions.similarity import FSDP2, SKELETON, check

ROOT = Path(__file__).resolve().parents[2]
REFERENCE, VARIANT = ROOT / "solution" / "fsdp.py", ROOT / "solution" / "tests" / "variant_fsdp.py"


@pytest.fixture
def batch_files(tmp_path) -> list[Path]:
    """The reference, the variant, the reference renamed apart (all it defines beyond the skeleton,
    every local; still a working FSDP) and re-spaced, and FSDP2 pasted in: one batch, as a
    grader would run it."""
    ref, var, renamed = tmp_path / "reference.py", tmp_path / "variant.py", tmp_path / "renamed.py"
    ref.write_text(REFERENCE.read_text())
    var.write_text(VARIANT.read_text())
    renamed.write_text(rename(REFERENCE.read_text(), keep=similarity.defined_names(SKELETON.read_text())))
    return [ref, var, renamed, fsdp2_pasted(tmp_path)]


def test_renamed_copy_is_flagged_and_honest_solutions_are_not(batch_files):
    renamed = batch_files[2].read_text()
    assert "q0_" in renamed and renamed != REFERENCE.read_text(), "nothing was renamed"
    batch = check(batch_files)
    assert score(batch, "reference.py", "renamed.py").flagged
    assert batch.columns("renamed.py")["similar_to"] == "reference.py"
    for a, b in (("reference.py", "variant.py"), ("reference.py", FSDP2), ("variant.py", FSDP2),
                 ("variant.py", "renamed.py"), ("reference.py", "pasted.py"), ("variant.py", "pasted.py")):
        m = score(batch, a, b)
        assert not m.flagged and m.score < similarity.FLAG / 2, m  # far from the line, not just under it
    assert batch.columns("variant.py")["flagged"] == "no" and batch.columns("pasted.py")["flagged"] == "yes"


def test_renamed_copy_needs_normalising(batch_files, monkeypatch):
    """Compared as written, only the statements with no renamed name in them still match: about half
    (the copy keeps the skeleton's names and the API's), where normalised it is all."""
    normalised = score(check(batch_files[:3]), "reference.py", "renamed.py")
    monkeypatch.setattr(similarity, "normalise", lambda line, defined, attributes="": [t.string for t in line.tokens])
    similarity.fsdp2_code.cache_clear()
    try:
        as_written = score(check(batch_files[:3]), "reference.py", "renamed.py")
    finally:
        similarity.fsdp2_code.cache_clear()
    assert normalised.score > 0.9 and as_written.score < 0.6, (normalised, as_written)


def test_the_reference_is_all_own_code_and_only_that():
    """Its own code is its exercise regions: no given line, and every region's code is in."""
    blocks = similarity.own_code(REFERENCE.read_text(), SKELETON.read_text())
    text = " ".join(line.text for block in blocks for line in block)
    for region_code in ("all_gather_into_tensor", "reduce_scatter_tensor", "resize_ ( 0 )", "pending_reduce"):
        assert region_code in text, region_code
    for given in ("def check_storage", "class FSDPGroup", "def fully_shard", "_check_arguments ("):
        assert given not in text, given
