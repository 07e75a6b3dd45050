"""Tests for train.py: determinism, DDP against FSDP2, flag validation, the command line,
the VS Code launch configs, and the README's profiled torchrun run end to end.

Distributed runs use the spawned CPU ranks of conftest's `pool2` (about 1-3 s per short
run); the command-line tests start real processes, and the torchrun ones import torchtitan
in every rank, so they take 30-60 s each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import tyro

import train
from harness import distributed, impl, model_setup
from harness.distributed import free_port
from harness.errors import ConfigError
from harness.tests.test_platform import show
from harness.tools.grading import jobs, policy
from harness.tools.grading.ranks import RankError, RankPool

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = "${workspaceFolder}/.venv/bin/python"


def small(**overrides) -> train.Config:
    """Three short steps of the debug model, without profiling or logging."""
    base = dict(model="debug", num_steps=3, seq_len=32, batch_size=2, profile_steps=0, log=False, device="cpu")
    return train.Config(**{**base, **overrides})


def numbers(results: list[train.TrainResult]) -> tuple[list[float], list[float]]:
    """(losses, grad norms), after checking that every rank reports the same ones: the loss is
    all-reduced and the grad norm is global, so ranks that disagree are out of step."""
    first = (results[0].losses, results[0].grad_norms)
    for rank, r in enumerate(results[1:], start=1):
        assert (r.losses, r.grad_norms) == first, (
            f"rank {rank} reports losses {r.losses} and grad norms {r.grad_norms}; rank 0 {first}"
        )
    return first


@pytest.fixture(scope="module")
def fsdp2_small(pool2) -> tuple[list[float], list[float]]:
    return numbers(pool2.run(train.train, small()))


# --------------------------------------------------------------------------- determinism


def test_same_config_gives_identical_numbers(pool2, fsdp2_small):
    again = numbers(pool2.run(train.train, small()))
    assert again == fsdp2_small, (
        f"a second run of the same config in the same ranks differs:\n first {fsdp2_small}\n again {again}\n"
        "something in train() depends on state left by the earlier run (seeding, a cached module, the data order)"
    )
    # Fresh processes: catches numbers that depend on process state rather than on the config.
    with RankPool(2, device="cpu") as fresh:
        elsewhere = numbers(fresh.run(train.train, small()))
    assert elsewhere == fsdp2_small, (
        f"the same config in freshly spawned ranks differs:\n first {fsdp2_small}\n fresh {elsewhere}"
    )


# --------------------------------------------------------------------------- DDP (--fsdp none) against FSDP2


def test_ddp_matches_fsdp2_at_step_1(pool2, fsdp2_small):
    losses, norms = numbers(pool2.run(train.train, small(fsdp="none")))
    ref_losses, ref_norms = fsdp2_small
    # Same seed, same init, same data, and the all-gather rebuilds the exact parameters, so
    # the first forward computes the same numbers bit for bit.
    assert losses[0] == ref_losses[0], (
        f"step-1 loss: DDP {losses[0]!r}, FSDP2 {ref_losses[0]!r}; before any update both run the same "
        "forward on the same data, so init or data differ between --fsdp none and fsdp2"
    )
    # The gradients themselves are bit-identical too, but the grad norm is not: a float32 norm on
    # CPU over the 524k-element output layer is off by ~1e-4 relative, and FSDP2 sums per-shard
    # norms while DDP takes the norm of the whole tensor, so the rounding differs.
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-3), (
        f"step-1 grad norm: DDP {norms[0]!r}, FSDP2 {ref_norms[0]!r}: more than rounding apart"
    )


def test_ddp_matches_fsdp2_every_step_without_clipping(pool2):
    # With clipping out of reach the clip coefficient is exactly 1, so the (differently rounded)
    # grad norm no longer feeds into the update: equal gradients give equal parameters, and
    # every later loss must match bit for bit as well.
    no_clip = dict(max_grad_norm=1e9)
    ddp, _ = numbers(pool2.run(train.train, small(fsdp="none", **no_clip)))
    fsdp2, _ = numbers(pool2.run(train.train, small(fsdp="fsdp2", **no_clip)))
    assert ddp == fsdp2, (
        f"without clipping, DDP losses {ddp} and FSDP2 losses {fsdp2} differ: the two compute different "
        "gradients or apply them differently"
    )


def device_job(gpus: int) -> tuple[str, str | None]:
    """On a rank: which device `auto` and `cuda` resolve to in the running gloo group, on a
    machine pretending to have `gpus` GPUs."""
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=gpus):
        auto = str(distributed.current_device("auto"))
        try:
            distributed.current_device("cuda")
            cuda_error = None
        except ConfigError as e:
            cuda_error = str(e)
    return auto, cuda_error


def test_auto_device_follows_the_running_process_group(pool2):
    # With a GPU per rank, `auto` alone would pick CUDA; inside the CPU pool's gloo group it must
    # stay on CPU (test.py trains there with the default --device auto), while an explicit
    # --device cuda is a contradiction worth an error.
    auto, cuda_error = pool2.run(device_job, 2)[0]
    assert auto == "cpu", f"--device auto in a gloo process group resolved to {auto}, expected cpu"
    assert cuda_error is not None and "--device cuda" in cuda_error and "gloo" in cuda_error, cuda_error


# --------------------------------------------------------------------------- flag validation


def config_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def assert_mentions(message: str, *fragments: str) -> None:
    missing = [f for f in fragments if f not in message]
    assert not missing, f"the error message lacks {missing}:\n{message}"


VALIDATE_CASES = {
    "reshard between micro-steps without accumulation": (
        dict(reshard_after_backward_before_last_backward=False),
        ["--no-reshard-after-backward-before-last-backward", "--num-gradient-accumulation-steps >= 2"],
    ),
    "reduce between micro-steps without accumulation": (
        dict(reduce_grads_before_last_backward=False),
        ["--no-reduce-grads-before-last-backward", "--num-gradient-accumulation-steps >= 2"],
    ),
    "more profiled steps than steps": (
        dict(num_steps=3, profile_steps=5), ["--profile-steps", "between 0 and --num-steps (3)", "got 5"],
    ),
    "no steps": (dict(num_steps=0, profile_steps=0), ["--num-steps", ">= 1", "got 0"]),
    "param dtype without FSDP": (
        dict(fsdp="none", param_dtype="bfloat16"), ["--param-dtype", "--fsdp none", "use --fsdp fsdp2 or effdl"],
    ),
    "reduce dtype without FSDP": (
        dict(fsdp="none", reduce_dtype="float32"), ["--reduce-dtype", "--fsdp none", "use --fsdp fsdp2 or effdl"],
    ),
    "no reshard after forward without FSDP": (
        dict(fsdp="none", reshard_after_forward=False),
        ["--no-reshard-after-forward", "--fsdp none", "use --fsdp fsdp2 or effdl"],
    ),
    "no reshard after backward without FSDP": (
        dict(fsdp="none", num_gradient_accumulation_steps=2, reshard_after_backward_before_last_backward=False),
        ["--no-reshard-after-backward-before-last-backward", "--fsdp none", "use --fsdp fsdp2 or effdl"],
    ),
    # DDP all-reduces every micro-step regardless, so the flag would silently do nothing.
    "no reduce before last backward without FSDP": (
        dict(fsdp="none", num_gradient_accumulation_steps=2, reduce_grads_before_last_backward=False),
        ["--no-reduce-grads-before-last-backward", "--fsdp none", "use --fsdp fsdp2 or effdl"],
    ),
    "snapshots dir without memory profiling": (
        dict(profile_memory=False, snapshots_dir=Path("snaps")),
        ["--snapshots-dir", "--no-profile-memory", "drop one of the two"],
    ),
    "--impl with FSDP2": (dict(fsdp="fsdp2", impl="other.py"), ["--impl other.py", "needs --fsdp effdl"]),
    "--impl path that does not exist": (
        dict(fsdp="effdl", impl="no/such/fsdp.py"), ["--impl no/such/fsdp.py", "is missing", "check the path"],
    ),
    "--impl not a .py file": (
        dict(fsdp="effdl", impl="fsdp.txt"), ["--impl", "'fsdp.txt'", "student or the path of a .py file"],
    ),
}


@pytest.mark.parametrize("overrides, fragments", VALIDATE_CASES.values(), ids=VALIDATE_CASES.keys())
def test_validate_rejects_with_flag_and_fix(overrides, fragments):
    cfg = dataclasses.replace(small(), **overrides)
    assert_mentions(config_error(train.validate, cfg), *fragments)


def test_compile_needs_a_cxx_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert_mentions(config_error(train.validate, small(compile=True)),
                    "--compile", "C++ compiler", "no-such-c++", "install one", "drop --compile")
    train.validate(small())  # without --compile no compiler is needed


def test_impl_path(tmp_path, monkeypatch):
    assert impl.impl_path("student") == ROOT / "fsdp.py"
    assert impl.impl_path("fsdp.py") == ROOT / "fsdp.py"  # relative to the repository from anywhere
    assert_mentions(config_error(impl.impl_path, str(tmp_path / "gone.py")), "gone.py", "is missing", "check the path")
    assert_mentions(config_error(impl.impl_path, "fsdp"), "--impl", "'fsdp'", "path of a .py file")
    monkeypatch.setattr(impl, "STUDENT", tmp_path / "fsdp.py")
    assert_mentions(config_error(impl.impl_path, "student"), "--impl student", "is missing", "git checkout fsdp.py")


def test_runs_of_different_files_never_share_an_output_folder(tmp_path):
    other = tmp_path / "fsdp.py"
    other.write_text("")
    names = {impl.run_name("fsdp2", "student"), impl.run_name("none", "student"), impl.run_name("effdl", "student"),
             impl.run_name("effdl", "harness/impl.py"), impl.run_name("effdl", str(other))}
    assert len(names) == 5, names
    assert impl.run_name("effdl", "student") == "effdl" == impl.run_name("effdl", str(ROOT / "fsdp.py"))


@pytest.mark.parametrize("gpus", [0, 1])
def test_cuda_needs_a_gpu_per_rank(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # a binding would make 1 GPU per rank enough
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    message = config_error(distributed.pick_device, "cuda")
    assert_mentions(message, "--device cuda", f"found {gpus} GPU(s) for 2 rank(s)", "use --device cpu")
    assert distributed.pick_device("auto") == torch.device("cpu"), "--device auto must fall back to CPU"


def test_auto_picks_cuda_with_a_gpu_per_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.pick_device("auto") == torch.device("cuda", 1)


# --------------------------------------------------------------------------- the command line


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # A wide terminal keeps tyro from wrapping flags and choice lists across lines.
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*train_args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # torchrun's default static rendezvous listens on --master-port: a free one, not 29500,
    # so a run left over elsewhere on the machine cannot collide with it.
    return run_cli("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   "train.py", *train_args, timeout=timeout)


@pytest.fixture(scope="module")
def help_text() -> str:
    proc = run_cli("train.py", "--help")
    assert proc.returncode == 0, show(proc)
    return proc.stdout


def cli_flags(help_text: str) -> set[str]:
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text))


def test_help_lists_every_flag(help_text):
    expected = set()
    for f in dataclasses.fields(train.Config):
        flag = "--" + f.name.replace("_", "-")
        expected.add(flag)
        if f.default is True:
            expected.add(flag.replace("--", "--no-", 1))
    missing = expected - cli_flags(help_text)
    assert not missing, f"train.py --help does not list {sorted(missing)}:\n{help_text}"


def test_unknown_choice_names_the_valid_ones():
    proc = run_cli("train.py", "--fsdp", "foo")
    assert proc.returncode != 0, show(proc)
    out = proc.stdout + proc.stderr
    assert_mentions(out, "'foo'", "--fsdp", "'fsdp2'", "'effdl'", "'none'")


CLI_ERRORS = {
    "no steps": (["--num-steps", "0"], "error: --num-steps must be >= 1"),
    "FSDP flag with --fsdp none": (["--fsdp", "none", "--param-dtype", "bfloat16"], "error: --param-dtype"),
    # Raised while joining the process group rather than by validate().
    "cuda without GPUs": pytest.param(
        ["--device", "cuda"], "error: --device cuda needs one GPU per rank",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
    ),
}


@pytest.mark.parametrize("args, expected", CLI_ERRORS.values(), ids=CLI_ERRORS.keys())
def test_config_error_exits_2_without_traceback(args, expected):
    proc = run_cli("train.py", *args)
    assert proc.returncode == 2, show(proc)
    assert expected in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, f"a flag mistake should print one line, not a traceback\n{show(proc)}"


# --------------------------------------------------------------------------- .vscode/launch.json


def load_jsonc(path: Path) -> object:
    """JSON with // comments and trailing commas, as VS Code reads it."""
    text, out, i, in_string = path.read_text(), [], 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                out.append(text[i:i + 2])
                i += 2
                continue
            in_string = c != '"'
        elif c == '"':
            in_string = True
        elif text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
            continue
        out.append(c)
        i += 1
    return json.loads(re.sub(r",(\s*[}\]])", r"\1", "".join(out)))


def launch_configs() -> list[dict]:
    return load_jsonc(ROOT / ".vscode" / "launch.json")["configurations"]


def test_launch_configs_use_the_venv():
    for c in launch_configs():
        assert c.get("python") == VENV_PYTHON, f"{c['name']!r} runs {c.get('python')!r}, not {VENV_PYTHON!r}"
    settings = load_jsonc(ROOT / ".vscode" / "settings.json")
    assert settings.get("python.defaultInterpreterPath") == VENV_PYTHON, settings


def test_launch_configs_pass_flags_train_py_accepts(help_text):
    known = cli_flags(help_text)
    runs = [c for c in launch_configs() if "train.py" in c.get("args", [])]
    assert runs, "launch.json has no config that runs train.py"
    for c in runs:
        args = c["args"]
        assert c.get("module") == "torch.distributed.run" and args[:2] == ["--nproc-per-node", "2"], (
            f"{c['name']!r} should start train.py under torchrun with 2 ranks: {c.get('module')} {args}")
        train_args = args[args.index("train.py") + 1:]
        unknown = [a for a in train_args if a.startswith("--") and a.split("=")[0] not in known]
        assert not unknown, f"{c['name']!r} passes {unknown}, which train.py --help does not list"
        # The values must parse and the combination must pass validation, as train.py would see it.
        problem = config_problem(train_args)
        assert problem is None, f"{c['name']!r}: train.py {' '.join(train_args)} would stop: {problem}"


def config_problem(train_args: list[str]) -> str | None:
    try:
        cfg = tyro.cli(train.Config, args=train_args)
    except SystemExit:
        return "tyro rejects these arguments (run train.py with them to see why)"
    try:
        train.validate(cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_launch_pytest_config_names_a_real_test():
    tests = [c for c in launch_configs() if c.get("module") == "pytest"]
    assert tests, "launch.json has no pytest config"
    for c in tests:
        for arg in c["args"]:
            if "::" in arg:
                file, name = arg.split("::", 1)
                name = name.split("[", 1)[0]  # a parametrized case: its function must exist
                assert re.search(rf"^def {re.escape(name)}\(", (ROOT / file).read_text(), re.M), (
                    f"{c['name']!r} runs {arg}, which {file} does not define")


# --------------------------------------------------------------------------- the skeleton stops with its TODO


SKELETON_UNDONE = impl.task1_undone(ROOT / "fsdp.py")
needs_skeleton = pytest.mark.skipif(not SKELETON_UNDONE, reason="fsdp.py has task 1 done")


@needs_skeleton
def test_skeleton_stops_at_task1_in_ranks(pool2):
    with pytest.raises(RankError) as e:
        pool2.run(jobs.train_job, policy.config("student"))
    assert_mentions(str(e.value), "TODO(task1)", "TodoError")
    assert len(set(pool2.run(os.getpid))) == 2  # every rank failed alike: the pool is still usable


@needs_skeleton
def test_skeleton_stops_at_task1_on_the_command_line():
    proc = torchrun("--fsdp", "effdl", "--impl", "student", "--num-steps", "2", "--seq-len", "32",
                    "--profile-steps", "0")
    assert proc.returncode != 0, show(proc)
    assert "error: TODO(task1): " in proc.stderr, f"train.main should print the TODO as one line\n{show(proc)}"
    # torchrun always ends a failed run with its summary; its last words must be the TODO, not a
    # link to torchrun's docs (the border of '=' around the summary aside).
    last = [line for line in proc.stderr.splitlines() if line.strip().strip("=")][-1]
    assert "TODO(task1)" in last, f"the TODO is not the last thing printed: {last!r}\n{show(proc)}"


def test_1b_flavour_has_llama_3_2_1b_shapes():
    """Built on the meta device (no memory): 16 blocks of dim 2048, 8 KV heads, vocab 128256."""
    from torchtitan.models.llama3 import Transformer

    with torch.device("meta"):
        model = Transformer(model_setup.model_args("1b", seq_len=2048, vocab_size=2048))
    assert len(model.layers) == 16 and model.output.weight.shape == (128256, 2048)
    assert model.layers["0"].attention.wk.weight.shape == (512, 2048)  # 8 KV heads of 64
    assert model.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    assert 1.4e9 < sum(p.numel() for p in model.parameters()) < 1.6e9  # untied embeddings
