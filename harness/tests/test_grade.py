"""harness.tools.grade: a folder of submissions -> one CSV row each; a broken one costs only its row."""

import csv

from harness.tools import grade


def test_grade_folder(tmp_path):
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "cheat.py").write_text("from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n")
    (folder / "hang.py").write_text("import torch\nwhile True:\n    pass\n")
    out = tmp_path / "points.csv"
    # Only the forward tests of one case, to keep this quick; graders run everything.
    grade.cli([str(folder), "--out", str(out), "--timeout", "60", "--", "-k", "world2-float32-float32 and forward"])
    rows = {r["submission"].rsplit("/", 1)[-1]: r for r in csv.DictReader(out.open())}
    assert rows["cheat.py"]["total"] == "0" and "uses PyTorch's FSDP2" in rows["cheat.py"]["failures"], rows["cheat.py"]
    assert rows["hang.py"]["total"] == "0" and "timed out" in rows["hang.py"]["failures"], rows["hang.py"]
    # Each submission's pictures beside the CSV: none here, and why (no profiled run; the session killed).
    said = {name: (tmp_path / "points-pictures" / name / "pictures.txt").read_text() for name in ("cheat", "hang")}
    assert "overlap.png: not drawn: tasks 2 and 3 did not run" in said["cheat"], said
    assert "no pictures: pytest did not reach the end of its session" in said["hang"], said
