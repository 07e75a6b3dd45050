"""Peak memory of initialisation per rank (meta-device init or not), next to harness/fit.py's
estimate of the sharded state: the numbers docs/measuring.md's Training features section quotes."""

from __future__ import annotations

import torch

from harness import model_setup
from harness.cli import parse
from harness.fit import estimate


def main(cfg) -> None:
    """Peak memory of initialisation per rank, next to the estimate; run it under torchrun:

        uv run torchrun --nproc-per-node 2 -m harness.tools.lab.init_memory --model 1b [--fsdp effdl] [--no-meta-init]

    Its flags are train.py's (cfg: a train.Config); those that shape the model and its wrapping count.
    """
    import torch.distributed as dist

    import train
    from harness import assets, memory
    from harness.distributed import init_distributed, shutdown_distributed

    device = init_distributed(cfg.device)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        vocab = assets.vocab_size(train.ROOT)
        before = memory.resident_bytes()
        memory.reset_peak(device)
        model = model_setup.build_model(cfg.model, cfg.seq_len, cfg.seed,
                                        torch.device("meta") if cfg.meta_init else device, vocab)
        mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
        if cfg.fsdp != "none":
            model = train.apply_fsdp(model, train.fsdp_module(cfg), mesh, cfg)
        if cfg.meta_init:
            model_setup.materialize(model, device, cfg.seed)
        peak = memory.peak(device)
        mine = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
        rows = [None] * world
        dist.all_gather_object(rows, (rank, before, peak, mine))
        if rank == 0:
            est = estimate(cfg, world, vocab)
            print(f"{cfg.fsdp} {cfg.model}, world {world}, meta_init={cfg.meta_init}: estimate of the sharded "
                  f"state per rank {est['parameters, gradients, AdamW state (float32)'] / 2**30:.2f} GiB")
            for r, b, p, m in rows:
                print(f"  rank {r}: rss before {b / 2**20:8.1f} MiB | peak during init {p / 2**20:8.1f} MiB | "
                      f"peak - before {(p - b) / 2**20:8.1f} MiB | own parameters {m / 2**20:8.1f} MiB", flush=True)
    finally:
        shutdown_distributed()


def cli(argv: list[str] | None = None) -> None:
    import train
    from harness.errors import BAD_INPUT, ConfigError, stop

    try:
        main(parse(train.Config, argv, prog="torchrun --nproc-per-node N -m harness.tools.lab.init_memory"))
    except ConfigError as e:  # a flag combination that cannot run; the message says how to fix it
        stop(str(e), BAD_INPUT)


if __name__ == "__main__":
    cli()
