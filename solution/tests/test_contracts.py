"""What the student file promises the grader: the profiler range names it reads."""

from types import SimpleNamespace

import pytest

from harness.tools.traces.schedule import WAIT_RANGE
from harness.tools.traces.trace import GROUP_RANGE
from solution import fsdp

ISSUED = [fsdp.ALL_GATHER_RANGE, fsdp.REDUCE_SCATTER_RANGE]
WAITED = [fsdp.ALL_GATHER_WAIT_RANGE, fsdp.REDUCE_SCATTER_WAIT_RANGE, fsdp.REDUCE_SCATTER_DONE_RANGE]


def names(phase: str) -> list[tuple[str, str | None]]:
    """The range a group named `layers.3` and the root's unnamed group give, with the fqn expected."""
    label = lambda fqn: fsdp.FSDPGroup.label(SimpleNamespace(fqn=fqn), phase)
    return [(label("layers.3"), "layers.3"), (label(""), None)]


@pytest.mark.parametrize("phase", ISSUED)
def test_issue_ranges_match_group_range(phase):
    for name, fqn in names(phase):
        assert (m := GROUP_RANGE.match(name)) and m["fqn"] == fqn, name
        assert not WAIT_RANGE.match(name), name


@pytest.mark.parametrize("phase", WAITED)
def test_wait_ranges_match_wait_range(phase):
    for name, fqn in names(phase):
        assert (m := WAIT_RANGE.match(name)) and m["what"] == phase and m["fqn"] == fqn, name
        assert not GROUP_RANGE.match(name), name


def test_every_wait_range_is_one_the_reference_opens():
    """WAIT_RANGE's alternatives are exactly the reference's three wait ranges."""
    alternatives = WAIT_RANGE.pattern.split("(?P<what>", 1)[1].split(")", 1)[0].split("|")
    assert sorted(alternatives) == sorted(WAITED)


def test_offload_policy_told_apart_without_fsdp2():
    """FSDP2's default OffloadPolicy() passes the argument check; CPUOffloadPolicy is unsupported.
    (No process group here: an accepted argument gets as far as asking for one.)"""
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    check = lambda policy: fsdp._check_modules([nn.Linear(2, 2)], {"offload_policy": policy})
    with pytest.raises(RuntimeError, match="process group"):
        check(OffloadPolicy())
    with pytest.raises(NotImplementedError, match="offload_policy=CPUOffloadPolicy"):
        check(CPUOffloadPolicy())
