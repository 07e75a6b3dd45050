"""harness.tools.benchmark end to end on a tiny setting: it runs, interleaves, and prints its table.

The figures themselves are not asserted (they depend on the machine); that each row has them is."""

import re

from harness.tools import benchmark
from harness.tests.test_platform import skip_unfinished


def test_benchmark_prints_ratios_and_hidden_shares(impl, capsys):
    skip_unfinished(impl)
    args = benchmark.Args(impl=impl, seq_lens=(64,), num_steps=3, repeats=2)
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    # interleaved: A B then B A
    runs = re.findall(r"seq 64 (fsdp2|effdl): \d+ ms/step", out)
    assert runs[:4] == ["fsdp2", "effdl", "effdl", "fsdp2"], out
    row = next(line for line in out.splitlines() if line.strip().startswith("64 |"))
    # step times and ratio, peaks and ratio, hidden shares of FSDP2 and hand-written
    assert re.search(r"\d+ ms +\d+ ms +\d+\.\d\d \|", row), row
    assert re.search(r"MiB +[\d.]+ MiB +\d\.\d{3} \|", row), row
    assert row.count("%") == 4, row
    assert "targets: step-time ratio <=" in out
