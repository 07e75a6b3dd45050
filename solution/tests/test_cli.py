"""The instructors' commands follow the students' in flags and errors (harness/tests/test_cli.py)."""

import pytest

from harness.tests.test_cli import assert_shared_flags, tool_help


@pytest.mark.parametrize("module", ["solution.make_skeleton", "solution.release"])
def test_help_uses_the_shared_flags(module, monkeypatch, capsys):
    assert_shared_flags(module, tool_help(module, monkeypatch, capsys), takes_impl=False)


def test_release_writes_to_out(monkeypatch, capsys):
    assert "--out PATH" in tool_help("solution.release", monkeypatch, capsys)
