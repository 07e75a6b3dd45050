"""What differs between the platforms the course runs on, in one place.

* **triton** is installed with torch on Linux only. torchtitan imports its MoE kernel module
  (`torchtitan.models.moe.kernels`, a triton kernel for routing tokens to experts) whenever
  `torchtitan.models` is imported, although the Llama model never calls it. Where triton
  cannot be imported, `install()` puts a stand-in for that one module in `sys.modules`: same
  names, each raising if ever called. No other torchtitan or torch code is replaced, so the
  model's numerics are those of the real modules.
* **Platform**: `platform()` is `sys.platform`, unless `FSDP_PLATFORM=darwin` asks to simulate
  macOS on Linux. The simulation takes every non-Linux code path here: triton is made
  unimportable (a meta-path blocker, so `import triton` fails as where it is not installed),
  memory is measured without `/proc` and without glibc's `mallopt` (harness/memory.py), and
  gloo is bound to the loopback interface explicitly (harness/distributed.py). What it cannot
  simulate: the macOS kernel and libc themselves (e.g. `ru_maxrss` in bytes, which is read
  by the real platform's rules) and Apple's Accelerate BLAS.

`install()` runs when the `harness` package is imported, so it precedes torchtitan in
train.py, in every rank a RankPool starts, and in the tools and tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import socket
import sys
import types

SIMULATE = "FSDP_PLATFORM"
KERNELS = "torchtitan.models.moe.kernels"


def platform() -> str:
    """`sys.platform`, or the one `FSDP_PLATFORM` simulates (only `darwin` is supported)."""
    forced = os.environ.get(SIMULATE, "")
    if forced not in ("", "darwin", sys.platform):
        raise RuntimeError(f"{SIMULATE}={forced!r} is not supported: use {SIMULATE}=darwin (simulate macOS) or unset it")
    return forced or sys.platform


def simulated() -> bool:
    return platform() != sys.platform


class _BlockTriton(importlib.abc.MetaPathFinder):
    """Makes `import triton` fail as it does where triton is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} ({SIMULATE}={platform()} blocks it)", name=name)
        return None


def triton_importable() -> bool:
    try:  # find_spec looks without importing (importing triton costs time in every process)
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def _kernels_stub() -> types.ModuleType:
    module = types.ModuleType(KERNELS, f"Stand-in for {KERNELS} where triton is absent (harness/compat.py).")

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{KERNELS} needs triton, which this platform lacks; the Llama model never "
                           "calls it (only torchtitan's mixture-of-experts models do)")

    module.generate_permute_indices = module.fill_indices_wrapper = unavailable
    module.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    module.__harness_stub__ = True
    return module


def install() -> None:
    """Idempotent: block triton under simulation; stand in for torchtitan's triton kernel module
    where triton is absent."""
    if simulated() and not any(isinstance(f, _BlockTriton) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockTriton())
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            del sys.modules[name]  # imported before the switch: forget it
    if KERNELS not in sys.modules and not triton_importable():
        sys.modules[KERNELS] = _kernels_stub()


def gloo_interface(master_addr: str) -> str | None:
    """The network interface gloo should use, or None for gloo's own choice.

    gloo binds to the address the host name resolves to. With every rank on this machine
    (MASTER_ADDR a loopback address) that must be the loopback interface: on macOS the host
    name often resolves to Wi-Fi's address or not at all, so the interface is named there
    (`lo0`); on Linux only when the host name does not resolve. Across machines (any other
    MASTER_ADDR) gloo chooses, or GLOO_SOCKET_IFNAME does."""
    if not _is_loopback(master_addr):
        return None
    if platform() != "darwin":
        try:
            socket.gethostbyname(socket.gethostname())
            return None
        except OSError:
            pass
    names = {name for _, name in socket.if_nameindex()}
    # macOS calls it lo0, Linux lo (the simulation on Linux gets lo: the name is the real one).
    return next((n for n in ("lo0", "lo") if n in names), None)


def _is_loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or socket.inet_aton(addr)[0] == 127
    except OSError:
        return False
