"""Training features, for FSDP2 and effdl alike: activation checkpointing,
meta-device initialisation, distributed checkpoints (save, resume, refusals), world size 1,
tied weights, and the memory-fit refusal. Numbers are compared bit for bit against FSDP2.

effdl is the FSDP under test (the file `--impl` names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import train
from harness import assets, checkpoint, fit, model_setup
from harness.tools.grading import checks, compare, jobs, policy
from harness.distributed import current_device
from harness.errors import ConfigError
from harness.tools.grading.ranks import RankError, Ranks
from harness.tests.test_platform import skip_unfinished


@pytest.fixture(scope="module")
def pool1():
    with Ranks(1, device="cpu") as pool:
        yield pool


@pytest.fixture(autouse=True)
def _needs_a_working_fsdp(request):
    """Tests of effdl against FSDP2 need one that trains: not the skeleton's TODOs."""
    if "impl" in request.fixturenames:
        skip_unfinished(request.getfixturevalue("impl"))


def short(impl: str | None, **overrides) -> train.Config:
    return policy.config(impl, num_steps=3, **overrides)


# --------------------------------------------------------------------------- rank-side jobs


class Recompute(nn.Module):
    """torch.utils.checkpoint around an FSDP module's call (the hooks run again in backward),
    the other order than torchtitan's, which a user may well write."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def init_weights(self, *args, **kwargs):  # the Llama's init_weights calls it on every block
        return self.block.init_weights(*args, **kwargs)


def recompute_outside_job(cfg: train.Config) -> jobs.Run:
    """train_job with every already-wrapped block called under torch.utils.checkpoint."""
    original = train.apply_fsdp

    def apply_then_checkpoint(model, fsdp, mesh, cfg):
        model = original(model, fsdp, mesh, cfg)
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, Recompute(block))
        return model

    with mock.patch.object(train, "apply_fsdp", apply_then_checkpoint):
        return jobs.train_job(cfg)


def init_digests_job(cfg: train.Config, plain_dtensor_init: bool = False) -> dict[str, str]:
    """Every rank's shard of every parameter right after wrapping (and materialising);
    plain_dtensor_init: without model_setup.FullTensorInit (DTensor's own random ops)."""
    seen = {}

    def inspect(model, step):
        if step == 0:
            seen.update({n: jobs.digest(p) for n, p in model.named_parameters()})

    passthrough = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
    plain = mock.patch.object(model_setup.FullTensorInit, "__torch_function__", passthrough)
    with plain if plain_dtensor_init else contextlib.nullcontext():
        train.train(dataclasses.replace(cfg, num_steps=1), inspect=inspect)
    return seen


def loaded_full_digests_job(cfg: train.Config) -> dict[str, str]:
    """Build and wrap as train.py does, load the latest checkpoint, digest the full parameters."""
    device = current_device("cpu")
    model = model_setup.build_model(cfg.model, cfg.seq_len, cfg.seed, torch.device("meta"),
                                     assets.vocab_size())
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    model = train.apply_fsdp(model, train.fsdp_module(cfg), mesh, cfg)
    model_setup.materialize(model, device, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step = checkpoint.load(cfg.checkpoint_dir, model, optimizer, cfg)
    return {"step": str(step), **{n: jobs.digest(p.full_tensor()) for n, p in model.named_parameters()}}


def too_big_job(cfg: train.Config, available: int) -> None:
    build = model_setup.build_model

    def only_on_meta(name, seq_len, seed, device, vocab_size, **overrides):
        if device.type != "meta":
            raise AssertionError("train.py built the model before checking that it fits")
        return build(name, seq_len, seed, device, vocab_size, **overrides)

    with mock.patch.object(fit, "available_bytes", return_value=available), \
            mock.patch.object(model_setup, "build_model", only_on_meta):
        train.train(cfg)


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's tie), in one group."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)       # 7 rows: 4/3 on 2 ranks, 3/3/1 on 3
        self.hidden = nn.Linear(6, 6)
        self.out = nn.Linear(6, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.embed(x))))


def tied_job(impl: str | None, split: bool = False) -> list[dict[str, torch.Tensor]]:
    """Train Tied 3 steps; per step the full parameters and gradients (split: `hidden` wrapped
    apart from the root, which holds both ends of the tie)."""
    fsdp = train.fsdp_module(policy.config(impl) if impl else policy.config())
    torch.manual_seed(0)
    model = Tied()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    if split:
        fsdp.fully_shard(model.embed, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    out = []
    for _ in range(3):
        x = torch.randint(0, 7, (4, 5), generator=gen)
        model(x).pow(2).mean().backward()
        if model.out.weight is not model.embed.weight:  # FSDP2 re-ties at its first forward
            raise AssertionError("the tie was broken by fully_shard: out.weight is no longer embed.weight")
        out.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out[-1].update({n: p.detach().full_tensor() for n, p in model.named_parameters()})
    return out


# --------------------------------------------------------------------------- activation checkpointing


# One end-to-end run per path: the mixed-precision case at world 2, the uneven shards of world 3 in float32.
@pytest.mark.parametrize("world,param_dtype,reduce_dtype", [(2, "bfloat16", "float32"), (3, "float32", "float32")])
def test_activation_checkpointing_matches_fsdp2(request, impl, world, param_dtype, reduce_dtype):
    pool = request.getfixturevalue(f"pool{world}")
    checks.check_step(pool, impl, param_dtype, reduce_dtype, num_steps=3, activation_checkpoint="full")


def test_activation_checkpointing_with_bonus_modes(pool2, impl):
    """All three bonus modes at once (each alone is graded by test.py without recomputation)."""
    checks.check_step(pool2, impl, "bfloat16", "float32", num_steps=3, activation_checkpoint="full",
                      **policy.mode_flags(["bonus1", "bonus2", "bonus3"]))


def test_activation_checkpointing_changes_nothing_numerically(pool2):
    """Recomputing gives the same bits as keeping the activations (FSDP2 with and without)."""
    with_ac = pool2.run(jobs.train_job, policy.as_fsdp2(short(None, activation_checkpoint="full")))
    without = pool2.run(jobs.train_job, policy.as_fsdp2(short(None)))
    assert with_ac[0].result.losses == without[0].result.losses
    # The names differ (layers.N._checkpoint_wrapped_module...), the shards must not.
    assert [[list(s.values()) for s in r.digests] for r in with_ac] == [[list(s.values()) for s in r.digests] for r in without]


def test_recompute_around_fsdp_module_matches_fsdp2(pool2, impl):
    """torch.utils.checkpoint around the FSDP module: its hooks run again inside backward."""
    cfg = short(impl, param_dtype="float32", reduce_dtype="float32")
    ref = checks.run(pool2, recompute_outside_job, policy.as_fsdp2(cfg))
    got = checks.run(pool2, recompute_outside_job, cfg)
    what = "checkpoint around each FSDP block, " + policy.describe(cfg, 2)
    compare.assert_same_numbers(ref[0].result, got[0].result, what)
    compare.assert_same_parameters([r.digests for r in ref], [r.digests for r in got], what)


# --------------------------------------------------------------------------- meta-device init


@pytest.mark.parametrize("world", [1, 3])
def test_meta_init_equals_full_init(request, impl, world):
    """Both FSDPs, built on meta and materialised shard by shard, hold exactly the rows of the
    full model's init (--no-meta-init), at every world size."""
    pool = request.getfixturevalue(f"pool{world}")
    for cfg in (short(None, fsdp="fsdp2"), short(impl)):
        meta = pool.run(init_digests_job, cfg)
        full = pool.run(init_digests_job, dataclasses.replace(cfg, meta_init=False))
        for rank, (a, b) in enumerate(zip(meta, full)):
            differ = [n for n in a if a[n] != b[n]]
            assert not differ, f"{cfg.fsdp}, world {world}, rank {rank}: meta init differs from full init in {differ[:3]}"


def test_meta_init_keeps_fsdp_none_comparable(pool2):
    """Same weights and data: FSDP2's first loss equals DDP's (--fsdp none) bit for bit."""
    fsdp2 = pool2.run(train.train, policy.as_fsdp2(short(None)))[0]
    ddp = pool2.run(train.train, short(None, fsdp="none"))[0]
    assert fsdp2.losses[0] == ddp.losses[0], (fsdp2.losses, ddp.losses)


def test_meta_init_check_fails_without_full_tensor_init(pool2):
    """Proof the check above can fail: DTensor's own random init on a CPU mesh draws the same
    rows on every rank, which is not the full model's init."""
    cfg = policy.as_fsdp2(short(None))
    plain = pool2.run(init_digests_job, cfg, True)
    full = pool2.run(init_digests_job, dataclasses.replace(cfg, meta_init=False))
    assert plain[0]["layers.0.attention.wq.weight"] != full[0]["layers.0.attention.wq.weight"]
    assert plain[0]["layers.0.attention.wq.weight"] == plain[1]["layers.0.attention.wq.weight"]  # same rows


# --------------------------------------------------------------------------- world size 1


@pytest.mark.parametrize("param_dtype,reduce_dtype", [("bfloat16", "float32")])
def test_world_size_1(pool1, impl, param_dtype, reduce_dtype):
    checks.check_step(pool1, impl, param_dtype, reduce_dtype, num_steps=3)
    checks.check_step(pool1, impl, param_dtype, reduce_dtype, num_steps=3, activation_checkpoint="full")


# --------------------------------------------------------------------------- tied weights


@pytest.mark.parametrize("world", [3])
def test_tied_weights_in_one_group_match_fsdp2(request, impl, world):
    pool = request.getfixturevalue(f"pool{world}")
    ref = checks.run(pool, tied_job, None)[0]
    got = checks.run(pool, tied_job, impl)[0]
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        for name in a:
            assert torch.equal(a[name], b[name]), f"tied weights, world {world}: {name} differs at step {step}"


def test_tied_weights_across_groups_refused(pool2, impl):
    with pytest.raises(RankError, match="tied weights across groups.*one fully_shard group"):
        pool2.run(tied_job, impl, True)


# --------------------------------------------------------------------------- checkpoints


def _resume(pool, saver: train.Config, resumer: train.Config, directory: Path):
    """(uninterrupted 6 steps, resumed run's results) with 3 steps saved by `saver`."""
    whole = checks.run(pool, jobs.train_job, dataclasses.replace(resumer, num_steps=6))
    checks.run(pool, jobs.train_job, dataclasses.replace(saver, num_steps=3, checkpoint_dir=directory))
    resumed = checks.run(pool, jobs.train_job, dataclasses.replace(resumer, num_steps=6, checkpoint_dir=directory,
                                                                      resume=True))
    return whole, resumed


# Across implementations both ways: effdl's checkpoints are FSDP2's format, saved and loaded.
@pytest.mark.parametrize("saved_by,resumed_by", [("fsdp2", "effdl"), ("effdl", "fsdp2")])
def test_resume_is_bit_identical(pool2, impl, tmp_path, saved_by, resumed_by):
    pick = lambda which: short(impl) if which == "effdl" else policy.as_fsdp2(short(impl))
    whole, resumed = _resume(pool2, pick(saved_by), pick(resumed_by), tmp_path)
    what = f"saved by {saved_by} after step 3, resumed by {resumed_by}"
    assert resumed[0].result.losses == whole[0].result.losses[3:], f"{what}: losses {resumed[0].result.losses}, uninterrupted {whole[0].result.losses}"
    assert resumed[0].result.grad_norms == whole[0].result.grad_norms[3:], what
    for rank, (w, r) in enumerate(zip(whole, resumed)):
        assert r.digests[1:] == w.digests[4:], f"{what}: rank {rank}'s shards differ from the uninterrupted run's"


def test_resume_with_bf16_and_activation_checkpointing(pool2, impl, tmp_path):
    cfg = short(impl, param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="full")
    whole, resumed = _resume(pool2, policy.as_fsdp2(cfg), cfg, tmp_path)
    assert resumed[0].result.losses == whole[0].result.losses[3:]


def test_resume_at_another_world_size(pool2, pool3, impl, tmp_path):
    """Saved at world size 2, loaded at 2 and at 3: the same full parameters; training goes on."""
    cfg = short(impl, checkpoint_dir=tmp_path)
    checks.run(pool2, jobs.train_job, cfg)
    at2 = checks.run(pool2, loaded_full_digests_job, cfg)[0]
    at3 = checks.run(pool3, loaded_full_digests_job, cfg)[0]
    assert at2 == at3 and at2["step"] == "3"
    more = checks.run(pool3, jobs.train_job, dataclasses.replace(cfg, num_steps=5, resume=True))[0].result
    assert len(more.losses) == 2 and all(l == l and l < 20 for l in more.losses), more.losses


def test_resume_refuses_another_run_shape(pool2, tmp_path):
    checks.run(pool2, jobs.train_job, policy.as_fsdp2(short(None, checkpoint_dir=tmp_path)))
    with pytest.raises(RankError, match="--seq-len"):
        pool2.run(train.train, policy.as_fsdp2(dataclasses.replace(
            short(None, checkpoint_dir=tmp_path, resume=True, seq_len=32), num_steps=5)))


@pytest.fixture(scope="module")
def saved_checkpoint(pool2, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    checks.run(pool2, jobs.train_job, policy.as_fsdp2(policy.config(None, num_steps=2, checkpoint_dir=directory,
                                                                       checkpoint_every=1)))
    return directory


def test_checkpoints_are_atomic_and_sharded(saved_checkpoint):
    names = sorted(p.name for p in saved_checkpoint.iterdir())
    assert names == ["step-000001", "step-000002"], names  # no temporary folder left behind
    files = sorted(p.name for p in (saved_checkpoint / "step-000002").iterdir())
    assert ".metadata" in files and "__0_0.distcp" in files and "__1_0.distcp" in files, files


def test_interrupted_save_keeps_the_last_good_checkpoint(saved_checkpoint, tmp_path):
    shutil.copytree(saved_checkpoint, tmp_path / "c")
    (tmp_path / "c" / ".tmp-step-000003").mkdir()  # a save killed halfway
    (tmp_path / "c" / ".tmp-step-000003" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path / "c").name == "step-000002"


def test_torn_checkpoint_refused(saved_checkpoint, tmp_path):
    shutil.copytree(saved_checkpoint, tmp_path / "c")
    (tmp_path / "c" / "step-000002" / ".metadata").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="torn.*delete that folder"):
        checkpoint.latest(tmp_path / "c")


@pytest.mark.parametrize("content,message", [
    (None, "holds no checkpoint"),
    (b"not a checkpoint", "not a readable DCP checkpoint"),
])
def test_foreign_checkpoint_refused(tmp_path, content, message):
    if content is not None:
        (tmp_path / "step-000001").mkdir()
        (tmp_path / "step-000001" / ".metadata").write_bytes(content)
    else:
        (tmp_path / "something-else").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(tmp_path, None, None, short(None))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # a one-process save, as meant
def test_dcp_checkpoint_of_another_program_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"weights": torch.ones(3)}, checkpoint_id=str(tmp_path / "step-000001"))
    with pytest.raises(checkpoint.CheckpointError, match="not one train.py wrote"):
        checkpoint.load(tmp_path, None, None, short(None))


def test_resume_of_a_finished_run(pool2, tmp_path):
    """Resuming at --num-steps trains nothing and says so; past it is refused, naming the fix."""
    cfg = policy.as_fsdp2(short(None, checkpoint_dir=tmp_path))
    checks.run(pool2, jobs.train_job, cfg)
    resumed = checks.run(pool2, jobs.train_job, dataclasses.replace(cfg, resume=True))
    assert resumed[0].result.losses == [], resumed[0].result
    assert "nothing left to train; pass a larger --num-steps" in checkpoint.nothing_left(cfg)
    with pytest.raises(RankError, match=r"is at step 3, past --num-steps 2: pass --num-steps 4 or more"):
        checks.run(pool2, jobs.train_job, dataclasses.replace(cfg, resume=True, num_steps=2, profile_steps=0))


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        train.validate(short(None, resume=True))
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.latest(Path("/nonexistent/ckpt"))


# --------------------------------------------------------------------------- memory fit


def test_estimate_of_the_sharded_state_falls_with_world_size():
    parts = {w: fit.estimate(policy.as_fsdp2(short(None, model="1b")), w, 128256) for w in (1, 2, 4)}
    key = "parameters, gradients, AdamW state (float32)"
    assert parts[1][key] == 2 * parts[2][key] == 4 * parts[4][key]
    assert 1.4e9 * 16 < parts[1][key] < 1.6e9 * 16
    no_meta = fit.estimate(policy.as_fsdp2(short(None, model="1b", meta_init=False)), 2, 128256)
    assert no_meta["the full model, built before sharding"] == parts[1][key] // 4
    ac = fit.estimate(policy.as_fsdp2(short(None, model="1b", activation_checkpoint="full", seq_len=1024)), 2, 128256)
    assert ac["activations"] < fit.estimate(policy.as_fsdp2(short(None, model="1b", seq_len=1024)), 2, 128256)["activations"]


def test_estimate_follows_width_and_depth_overrides():
    """--dim / --n-layers / --n-heads change the model, so they change the estimate."""
    key = "parameters, gradients, AdamW state (float32)"
    base = fit.estimate(policy.as_fsdp2(short(None)), 2, 2048)
    half = fit.estimate(policy.as_fsdp2(short(None, n_layers=3)), 2, 2048)
    wide = fit.estimate(policy.as_fsdp2(short(None, dim=512, n_heads=16)), 2, 2048)
    assert half[key] < base[key] < wide[key], (half[key], base[key], wide[key])
    assert half["activations"] * 2 == base["activations"] < wide["activations"]


def test_too_big_is_refused_before_building(pool2):
    cfg = policy.as_fsdp2(short(None, model="1b", seq_len=128, batch_size=1, num_gradient_accumulation_steps=1))
    with pytest.raises(RankError, match=r"(?s)--model 1b does not fit.*GiB is available.*--no-memory-check"):
        pool2.run(too_big_job, cfg, 8 * 2**30)


def test_small_run_fits():
    cfg = policy.as_fsdp2(short(None))
    assert fit.check(cfg, 2, 2, 2048, torch.device("cpu")) is None
    with mock.patch.object(fit, "available_bytes", return_value=2**20):
        assert "does not fit" in fit.check(cfg, 2, 2, 2048, torch.device("cpu"))
