"""The checks train.py runs on its Config before it starts."""

from __future__ import annotations

import os
import shutil
import sys

from harness import impl
from harness.errors import ConfigError


def validate(cfg) -> None:
    """Refuse a train.py Config that cannot run or would silently ignore a flag, naming the fix."""
    for name in ("num_steps", "seq_len", "batch_size", "num_gradient_accumulation_steps", "replicate"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.num_gradient_accumulation_steps < 2:
        for flag in ("reshard_after_backward_before_last_backward", "reduce_grads_before_last_backward"):
            if not getattr(cfg, flag):
                raise ConfigError(
                    f"--no-{flag.replace('_', '-')} only changes what happens between micro-steps, so it "
                    f"needs --num-gradient-accumulation-steps >= 2 (got {cfg.num_gradient_accumulation_steps})")
    if not 0 <= cfg.profile_steps <= cfg.num_steps:
        raise ConfigError(f"--profile-steps must be between 0 and --num-steps ({cfg.num_steps}), got {cfg.profile_steps}")
    if not cfg.profile_memory and cfg.snapshots_dir is not None:
        raise ConfigError("--snapshots-dir names where memory snapshots go, but --no-profile-memory writes none: "
                          "drop one of the two")
    if cfg.fsdp == "none":
        fsdp_only = {
            "--param-dtype": cfg.param_dtype != "none", "--reduce-dtype": cfg.reduce_dtype != "none",
            "--no-reshard-after-forward": not cfg.reshard_after_forward,
            "--no-reshard-after-backward-before-last-backward": not cfg.reshard_after_backward_before_last_backward,
            "--no-reduce-grads-before-last-backward": not cfg.reduce_grads_before_last_backward,
            "--replicate": cfg.replicate != 1,
        }
        if bad := [flag for flag, used in fsdp_only.items() if used]:
            raise ConfigError(f"{', '.join(bad)} configure FSDP; they do nothing with --fsdp none (use --fsdp fsdp2 or effdl)")
    if not cfg.prefetch and cfg.fsdp != "effdl":
        raise ConfigError(f"--no-prefetch switches effdl's prefetch off; it needs --fsdp effdl "
                          f"(FSDP2 on CPU prefetches nothing anyway; got --fsdp {cfg.fsdp})")
    if cfg.impl != "student" and cfg.fsdp != "effdl":
        raise ConfigError(f"--impl {cfg.impl} selects the file effdl imports, so it needs --fsdp effdl")
    impl.impl_path(cfg.impl)  # fails early on a bad --impl
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0 (0: save after the last step only), got {cfg.checkpoint_every}")
    if (cfg.resume or cfg.checkpoint_every) and cfg.checkpoint_dir is None:
        raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir DIR (where checkpoints are)")
    # Inductor's own choice of compiler: $CXX, else clang++ on macOS and g++ elsewhere.
    if cfg.compile and not shutil.which(cxx := os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")):
        raise ConfigError(f"--compile: inductor builds the compiled blocks with a C++ compiler and {cxx} is not on "
                          "PATH; install one (e.g. apt-get install g++, or point CXX at it) or drop --compile")
    if cfg.model == "debug" and cfg.seq_len > 2048:
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the data supports well; use <= 2048")
