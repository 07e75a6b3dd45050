"""The overlap picture on the reference and on a broken variant of it: the drawn bars show the
reference's forward all-gathers overlapping compute, and the picture's check fails for a reference
that waits for each prefetch at once; `pytest test.py --artifacts` draws both pictures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tests.test_pictures import assert_drawn, png_size
from harness.tools.grading import checks
from harness.tools.traces import pictures
from solution.tests.mutation import write_mutant

ROOT = Path(__file__).resolve().parents[2]


def draw(pool, impl: str, folder: Path) -> pictures.Overlap:
    """One short profiled run of FSDP2 and of `impl` (the profile tasks 2 and 3 judge), drawn."""
    checks.profile_both(pool, impl, folder)
    return pictures.overlap_png(folder / "fsdp2" / "traces", folder / "effdl" / "traces", folder / "overlap.png",
                                title=f"Overlap: FSDP2 and {Path(impl).name}")


def test_reference_overlaps_in_the_picture(pool2, tmp_path):
    drawing = draw(pool2, "solution/fsdp.py", tmp_path)
    assert png_size(tmp_path / "overlap.png")[0] >= 1000
    assert_drawn(drawing, (False, True))  # FSDP2 waits at once on CPU; the reference prefetches
    # Backward too: every reduce-scatter but each pass's last left in flight over compute.
    for rs in (b for b in drawing.panels[1].collectives("reduce_scatter", "backward") if b.required):
        assert rs.overlapped, rs


def test_picture_check_fails_for_a_prefetch_waited_at_once(pool2, tmp_path):
    drawing = draw(pool2, write_mutant(tmp_path, "wait-prefetch-at-once"), tmp_path)
    with pytest.raises(AssertionError, match=r"the forward all-gathers of \['layers.0', .*do not overlap"):
        assert_drawn(drawing, (False, True))


def test_pytest_artifacts_draws_both_pictures(tmp_path):
    """Task 2 and one memory case of `pytest test.py --artifacts DIR`: overlap.png with both
    panels, memory.json with both runs' peaks, memory.png."""
    folder = tmp_path / "artifacts"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test.py",
                           "--impl", "solution/fsdp.py", "-k", "task2 or task3_memory and float32-float32",
                           "--artifacts", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (folder / "pictures.txt").read_text() == "overlap.png: drawn\nmemory.png: drawn\n"
    assert png_size(folder / "overlap.png")[0] >= 1000 and png_size(folder / "memory.png")[0] >= 400
    memory = json.loads((folder / "memory.json").read_text())
    assert list(memory) == ["world 2, param_dtype=float32, reduce_dtype=float32, 2 micro-steps"], memory
    case = next(iter(memory.values()))
    assert len(case["fsdp2"]) == len(case["effdl"]) == 2 and case["margin"] > 0  # both ranks of both runs
    for who in ("fsdp2", "effdl"):
        assert (folder / "profiles" / who / "traces" / "rank0.json").is_file()
