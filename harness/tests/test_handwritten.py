"""The source check refuses FSDP2 and computed routes, and nothing an honest FSDP writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.tools import handwritten

# What a student may reasonably write next to a hand-written FSDP.
HONEST = {
    "stdlib": "import math, functools, itertools, dataclasses, enum, contextlib, collections, typing, weakref\n"
              "import warnings, logging, time\nfrom collections.abc import Iterable\nfrom typing import Any\n",
    "os_environ": "import os\nDEBUG = os.environ.get('FSDP_DEBUG') == '1' or os.getenv('X') is not None\n",
    "from_os": "from os import environ\n",
    "print_debugging": "import torch\ndef f(x):\n    print(f'{x.shape=} {x.dtype}', flush=True)\n    return x\n",
    "logging": "import logging\nlog = logging.getLogger(__name__)\nlog.debug('gathered %d', 3)\n",
    "timing": "import time\nt = time.perf_counter()\n",
    "getattr_literal": "def f(m):\n    return getattr(m, 'weight', None), hasattr(m, 'bias')\n",
    "setattr_computed": "def f(m, name, p):\n    setattr(m, name, p)\n",
    "dunders": "class A:\n    __slots__ = ('x',)\n    def __eq__(self, o):\n        return self.__class__ is o.__class__\n"
               "    def __hash__(self):\n        return id(self)\nif __name__ == '__main__':\n    print(A.__doc__)\n",
    "torch_submodules": "import torch.distributed as dist\nfrom torch.distributed.tensor import DTensor, Shard\n"
                        "from torch.autograd.graph import register_multi_grad_hook\nfrom torch.profiler import record_function\n",
}

# Refused constructs that are not FSDP2: (source, the line it names, words of what to do instead).
OUTSIDE = {
    "sys": ("x = 1\nimport sys\n", 2, "remove the import"),
    "sys_via_module": ("import logging\nm = logging.sys.modules\n", 2, "plain `import torch"),
    "getattr_aliased": ("import functools, torch\ng = functools.partial(getattr, torch.distributed)\n", 2,
                        "not called with a written-out name"),
    "os_system": ("import os\nos.system('ls')\n", 2, "os.system: of os an FSDP may read only"),
    "from_os_path": ("from os import path\n", 1, "of os an FSDP may read only"),
    "open": ("data = open('x').read()\n", 1, "reads no files"),
    "torch_open_file": ("import torch.serialization\nf = torch.serialization._open_file('x', 'rb')\n", 1,
                        "reads no files"),
    "torch_open_file_attribute": ("import torch\nf = torch.serialization._open_file('x', 'rb')\n", 2,
                                  "reads no files"),
    "torch_save": ("import torch\ntorch.save({}, 'x')\n", 2, "reads no files"),
    "getattr_computed": ("import torch\nname = 'a' + 'b'\ny = getattr(torch, name)\n", 3, "write the name out"),
    "numpy": ("import numpy\n", 1, "remove the import"),
    "logging_config": ("import logging.config\n", 1, "remove the import"),
    "dict_walk": ("import torch\nm = torch.distributed.__dict__\n", 2, "pass what you need as arguments"),
    "eval": ("x = eval('1')\n", 1, "write the code out"),
    "shared_memory": ("import torch\nt = torch.empty(4)\nt.share_memory_()\n", 3, "ordinary allocator"),
    "file_backed": ("import torch\ns = torch.UntypedStorage.from_file('f', True, 8)\n", 2, "ordinary allocator"),
}


def check(tmp_path: Path, source: str) -> str | None:
    f = tmp_path / "fsdp.py"
    f.write_text(source)
    return handwritten.static_problem(f)


@pytest.mark.parametrize("name", list(HONEST))
def test_honest_code_passes(tmp_path, name):
    assert check(tmp_path, HONEST[name]) is None


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_refusal_names_the_line_and_the_fix(tmp_path, name):
    source, line, advice = OUTSIDE[name]
    problem = check(tmp_path, source)
    assert problem is not None and f"fsdp.py:{line}" in problem and advice in problem, problem
    message = handwritten.verdict(problem)
    assert "FSDP2" not in message and handwritten.OUTSIDE in message, message


@pytest.mark.parametrize("source", ["from torch.distributed.fsdp import fully_shard\n",
                                    "import torch.distributed.fsdp as f\n",
                                    "from torch.distributed import fsdp\n",
                                    "from torch.distributed.fsdp._fully_shard import _fully_shard\n",
                                    "from torch.distributed.fsdp import OffloadPolicy\n"])
def test_fsdp2_is_called_fsdp2(tmp_path, source):
    assert handwritten.verdict(check(tmp_path, source)).startswith(handwritten.FSDP2_USED)


def test_task1_undone_reads_the_raise_not_the_words(tmp_path):
    """Tests that need a training FSDP skip a file that still raises task 1's TodoError, and only
    that: the words in a docstring or comment (the reference's TodoError docstring) do not count."""
    from harness.impl import task1_undone

    f = tmp_path / "fsdp.py"
    f.write_text('class TodoError(NotImplementedError):\n    """e.g. raise TodoError("TODO(task1): x")"""\n')
    assert not task1_undone(f)
    f.write_text('def shard():\n    raise TodoError("TODO(task1): shard this parameter")\n')
    assert task1_undone(f)
