"""Every check in test.py can fail: run it against a deliberately broken reference.

Each mutant (solution/tests/mutation.py, which holds them all) is the reference with snippets
replaced; each snippet must still be in solution/fsdp.py (a mutant that silently stops mutating
would prove nothing).
"""

from pathlib import Path

import pytest

from harness.tools.grading import checks, fsdp2_cache
from harness.tools.grading.ranks import RankError
from solution import make_skeleton
from solution.tests import conformance
from solution.tests.mutation import MUTANTS, write_mutant

SOLUTION = make_skeleton.SOLUTION


@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mutants")

    def make(name: str) -> str:
        return write_mutant(folder, name)

    return make


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_still_mutates(mutant, name):
    """Fast and first: a reworded reference must not leave a mutant silently stale (every mutant of
    the registry, whichever test file runs it)."""
    assert Path(mutant(name)).read_text() != SOLUTION.read_text()


@pytest.mark.parametrize("name, world, precision, message", [
    # Dividing first changes the rounding of the sum: a loss, a grad norm or (first, in torch 2.11) a
    # shard differs by a few ulps.
    ("predivide", 3, ("float32", "float32"), r"differs (at step|from FSDP2's after step)"),
    ("overwrite-grad", 2, ("float32", "float32"), "differs at step"),
    ("ignore-reduce-dtype", 2, ("bfloat16", "float32"), "differs at step"),
    ("tensor-split-rows", 3, ("float32", "float32"), "torch.chunk gives it"),
    ("no-reshard-after-backward", 2, ("float32", "float32"), "not a DTensor"),
])
def test_parity_check_fails(mutant, request, name, world, precision, message):
    pool = request.getfixturevalue(f"pool{world}")
    with pytest.raises(AssertionError, match=message):
        checks.check_step(pool, mutant(name), *precision)


def test_collective_beside_the_logged_ones_fails(mutant, pool2):
    """A collective FSDP2 does not issue (a broadcast in forward) is named, whatever it carries."""
    with pytest.raises(AssertionError, match=r"issues collectives FSDP2 does not in forward \(broadcast\)"):
        checks.check_forward(pool2, mutant("side-channel-broadcast"), "float32", "float32")


def test_collective_inside_dtensor_dispatch_fails(mutant, pool2):
    """An all-gather DTensor issues inside its own dispatch (a redistribution the file asked for) is logged."""
    with pytest.raises(AssertionError, match=r"forward collectives differ from FSDP2's: effdl sent 1 x all-gather"):
        checks.check_forward(pool2, mutant("side-channel-dtensor"), "float32", "float32")


def test_output_read_before_its_wait_fails(mutant, pool2):
    """An all-gather's output polled until it is there (then waited for later, where the wait finds it done): the
    collective log names the read ([Note: a collective's result read before its wait] in jobs.py)."""
    with pytest.raises(AssertionError, match=r"reads the output of an asynchronous all-gather before its work handle"):
        checks.check_forward(pool2, mutant("poll-all-gather-output"), "float32", "float32")


@pytest.mark.parametrize("name, message", [
    ("read-all-gather-output-by-printing", r"reads the output of an asynchronous all-gather before its work handle"),
    ("read-all-gather-output-by-a-tensor-made-from-it", r"reads the output of an asynchronous all-gather before its work"),
    ("read-all-gather-output-by-a-tensor-made-from-a-deque", r"torch.tensor makes a tensor from a deque"),
    ("read-all-gather-output-in-a-sequence-torch-reads", r"torch's zeros is handed a _Size, which torch reads by the"),
    ("read-all-gather-output-in-a-slots-dataclass-torch-reads", r"torch's zeros is handed a _Size, which torch reads by"),
    ("read-all-gather-output-in-a-callback", r"torch's interpolate is handed a _Look, which torch may call"),
    ("read-all-gather-output-through-a-map", r"torch's unfold is handed a map, which torch may call"),
    ("read-all-gather-output-through-a-lists-iterator", r"torch's unfold is handed a list_iterator, which torch may"),
    ("read-all-gather-output-through-a-weak-set", r"code of the file ran inside torch's unfold"),
    ("read-all-gather-output-in-a-generators-finally", r"code of the file ran inside torch's .*__set__"),
    ("read-all-gather-output-through-a-dtensor-formatted", r"reads the output of an asynchronous all-gather before"),
    ("read-all-gather-output-in-a-set-torch-prints", r"torch's printing of a tensor reads the output of an asynchronous")])
def test_output_read_where_the_dispatcher_does_not_show_it_fails(mutant, pool2, name, message):
    """The same read by code that runs past the dispatcher (printing, torch.tensor of its elements, whatever sequence
    holds them): the log's function mode names it ([Note: reads the dispatcher does not show] in jobs.py)."""
    with pytest.raises(AssertionError, match=message):
        checks.check_forward(pool2, mutant(name), "float32", "float32")


def test_output_read_in_backward_fails(mutant, pool2):
    """The same read in backward, where the file's hooks run inside torch's backward: the log's function mode runs
    it with itself on ([Note: reads the dispatcher does not show] in jobs.py); the forward is clean (the control)."""
    path = mutant("read-all-gather-output-by-printing-in-backward")
    checks.check_forward(pool2, path, "float32", "float32")
    with pytest.raises(AssertionError, match=r"\(backward\).*reads the output of an asynchronous all-gather before"):
        checks.check_step(pool2, path, "float32", "float32")


def test_output_read_before_its_wait_fails_in_a_profiled_run(mutant, pool2, tmp_path):
    """The same poll in the profiled runs task 2 and 3 are judged from: the collective log is on there too, so a
    program that polled only where it found no log (under the marks, the trace shows the compute after the poll
    as overlapped) has its read named there."""
    with pytest.raises(AssertionError, match=r"profiled.*reads the output of an asynchronous all-gather before its work"):
        checks.profile_both(pool2, mutant("poll-all-gather-output"), tmp_path / "profiles")


def test_odd_shapes_check_fails(mutant, pool3):
    with pytest.raises(AssertionError, match="torch.chunk gives it"):
        checks.check_odd_shapes(pool3, mutant("tensor-split-rows"))


def test_conformance_frozen_check_fails(mutant, pool2, pool3):
    """Frozen parameters in a group: a slot for each in the reduce-scatter changes the bits at world
    size 3 (at 2, a sum of two values is the same either way round)."""
    with pytest.raises(AssertionError, match="frozen, world 3, .* differs from FSDP2's"):
        conformance.check(pool3, "frozen", mutant("zero-fill-every-slot"), "bfloat16", "bfloat16")
    conformance.check(pool2, "frozen", mutant("zero-fill-every-slot"), "bfloat16", "bfloat16")


def test_conformance_twice_check_fails(mutant, pool2):
    with pytest.raises(RankError, match="setStorage"):
        conformance.check(pool2, "twice", mutant("pre-backward-once-per-step"), "float32", "float32")


def test_predivide_is_invisible_at_world_2(mutant, pool2):
    """Why test_fsdp also runs at world size 3: at 2 every division order happens to agree."""
    checks.check_step(pool2, mutant("predivide"), "float32", "float32")


@pytest.mark.parametrize("name, message", [
    ("no-reshard-after-forward", "peak memory per step"),
    ("leak-gather-buffers", "leaks every step"),
    ("prefetch-all-until-step-4", "peak memory per step"),
    ("hold-every-group-in-step-2", "peak memory in step 2"),
])
def test_memory_check_fails(mutant, pool2, name, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_memory(pool2, mutant(name), "float32", "float32")


def test_every_group_gathered_at_once_fails_overlap_and_memory(mutant, pool2, tmp_path):
    """Every later group prefetched at once (each all-gather still waited for after another group's compute, so
    each looks overlapped) is not the task's schedule: more than a group's own and the next all-gather in flight
    fails tasks 2 and 3, and task 3 judges the memory of the run whose overlap it judges, which that schedule
    exceeds, whatever a memory run shows (a program that times its own ops could tell a memory run from a
    profiled one and be lean only in the former)."""
    profiles = checks.profile_both(pool2, mutant("prefetch-all-until-step-4"), tmp_path / "profiles", memory=True)
    for which in ("forward", "backward"):
        with pytest.raises(AssertionError, match=r"all-gathers in \w+ward: \d were in flight at once"):
            checks.assert_overlap(profiles, which)
    with pytest.raises(AssertionError, match=r"profiled: rank \d's peak memory per step"):
        checks.assert_profiled_memory(profiles)


@pytest.mark.parametrize("name, fails, passes", [
    ("prefetch-two-ahead", ["forward", "backward"], []),
    ("prefetch-before-own-wait-early-copy-out", ["forward"], ["backward"]),
    ("prefetch-before-own-wait-synchronize", ["forward"], ["backward"]),
])
def test_overlap_check_fails_with_two_all_gathers_in_flight(mutant, pool2, tmp_path, name, fails, passes):
    """Two groups ahead (each all-gather waited for after another group's compute; one more block fits task 3's
    memory allowance) is not FSDP2's schedule, which has one all-gather in flight at a time. An empty copy-out
    range opened before the next issue does not end a group's own all-gather, nor a synchronize() there (it returns
    at once on gloo): a wait that finds or makes its Work done does."""
    profiles = checks.profile_both(pool2, mutant(name), tmp_path / "profiles")
    for which in fails:
        with pytest.raises(AssertionError, match=rf"all-gathers in {which}: 2 were in flight at once"):
            checks.assert_overlap(profiles, which)
    for which in passes:
        checks.assert_overlap(profiles, which)


def test_overlap_check_fails_with_every_reduce_scatter_in_flight(mutant, pool2, tmp_path):
    """Every reduce-scatter left running until the end of backward overlaps the compute after it, and holds every
    group's gradient buffers at once: FSDP2 finishes the previous group's before issuing the next, one in flight."""
    profiles = checks.profile_both(pool2, mutant("reduce-scatters-all-in-flight"), tmp_path / "profiles")
    with pytest.raises(AssertionError, match=r"reduce-scatters in backward: [3-9] were in flight at once \(rank 0, step "
                                             r"\d+: layers\.5, layers\.4, layers\.3"):
        checks.assert_overlap(profiles, "backward")
    checks.assert_overlap(profiles, "forward")


def test_overlap_check_fails_two_groups_ahead_with_one_in_flight(mutant, pool2, tmp_path):
    """The next group's all-gather waited for mid-block (from a hook on a block's child, after some of its compute)
    and the one after it issued there: one all-gather in flight at a time, each waited for after another group's
    compute, and three groups gathered, two ahead of the one computing (which group's model compute has begun is
    the grader's to tell, not the program's range names)."""
    profiles = checks.profile_both(pool2, mutant("prefetch-mid-block"), tmp_path / "profiles")
    with pytest.raises(AssertionError, match=r"all-gathers in forward: issued 2 groups ahead of the groups computing"):
        checks.assert_overlap(profiles, "forward")
    checks.assert_overlap(profiles, "backward")


@pytest.mark.parametrize("name, fails, message", [
    ("all-gathers-under-swapped-names", ["forward", "backward"],
     r"rank 0, step \d+, \w+ward: layers\.[01]\.[\w.]+'s parameters, as the model read them, held data of the all-gather "
     r"issued as layers\.[01]'s, not layers\.[01]'s"),
    ("backward-copies-out-of-forward", ["backward"],
     r"rank 0, step \d+, backward pass \d: layers\.0\.[\w.]+'s parameters, as the model read them, held data of the "
     r"all-gathers of forward's \(an earlier pass of this step\) in \d+ reads?; under FSDP2 of backward's \(this pass\)"),
    ("backward-copies-out-of-forward-through-an-index", ["backward"],
     r"rank 0, step \d+, backward pass \d: layers\.0\.[\w.]+'s parameters, as the model read them, held data of the "
     r"all-gathers of backward's \(this pass\) and forward's \(an earlier pass of this step\)"),
    ("copy-out-after-synchronize", ["forward", "backward"],
     r"rank 0, step \d+, \w+ward: [\w.]+'s parameters, as the model read them, held bytes that no all-gather brought"),
    ("backward-alternately-reads-a-copy", ["backward"],
     r"rank 0, step \d+, backward pass \d: layers\.5\.[\w.]+'s parameters, as the model read them, held data of the "
     r"all-gathers of none in 0 reads; under FSDP2 of backward's \(this pass\) in \d+ reads?"),
    ("reduce-scatter-said-done-by-a-forged-tag", ["backward"],
     r"reduce-scatters in backward: 2 were in flight at once"),
    ("prefetch-second-block-first", ["forward"],
     r"all-gathers in forward: rank 0: issued for the groups in another order than FSDP2's \(number 2 of the profiled "
     r"steps': layers\.1's, under FSDP2 layers\.0's\)"),
])
def test_overlap_check_fails_when_a_collective_carries_another_groups_parameters(mutant, pool2, tmp_path, name, fails,
                                                                                 message):
    """Which group an all-gather is for is told by the data the model's leaves read (jobs.py's [Note: where the model's
    parameters came from]), not by its name alone: two blocks' all-gathers issued under each other's names, or a
    block's parameters in backward copied out of its forward all-gather's buffer (a block held gathered from
    forward), or put in the parameters' place in every second backward (a pass the log does not see is not covered
    by the honest ones), or read when synchronize() returned (at once on gloo: the data lands at a wait), fail; a
    reduce-scatter said done by a tag the program wrote itself is still in flight; and with honest names, the names
    must come in FSDP2's order (the second block's issued first)."""
    profiles = checks.profile_both(pool2, mutant(name), tmp_path / "profiles")
    for which in ("forward", "backward"):
        if which in fails:
            with pytest.raises(AssertionError, match=message):
                checks.assert_overlap(profiles, which)
        else:
            checks.assert_overlap(profiles, which)


@pytest.mark.parametrize("name, leaf", [
    ("swap-block-norms",
     r"layers\.1\.attention_norm \(called from outside the model\), under FSDP2 layers\.0\.attention_norm"),
    ("norm-called-through-a-module-of-its-own",
     r"layers\.0\.attention_norm \(called from outside the model\), under FSDP2 layers\.0\.attention_norm"),
])
def test_overlap_check_fails_when_the_model_is_rearranged(mutant, pool2, tmp_path, name, leaf):
    """Which group computes when is told by the model's leaf that runs, and only where its parent's forward called
    it: two blocks' norms swapped (each position still given its own group's weight: the same numbers), or each
    norm called through a module of the FSDP's put in its place (the same leaves in the same order), run another
    order of the model's leaves than FSDP2's."""
    profiles = checks.profile_both(pool2, mutant(name), tmp_path / "profiles")
    for which in ("forward", "backward"):
        with pytest.raises(AssertionError, match=r"rank 0: the model's leaves ran in another order than under FSDP2 "
                                                 rf"\(forward \d+ of the profiled steps': {leaf};"):
            checks.assert_overlap(profiles, which)


@pytest.mark.parametrize("name, message", [
    ("own-graph-before-own-wait", r"all-gathers in backward: 0 of the \d+ that can overlap compute did"),
    ("call-leaf-node-before-own-wait", r"ran \d+ forwards and \d+ backward nodes in the profiled steps, under FSDP2"),
])
def test_a_model_node_called_by_hand_is_not_compute(mutant, pool2, tmp_path, name, message):
    """No backward prefetch, and backward nodes run between each all-gather's issue and its wait: those of a graph
    the program differentiates itself are not the model's compute, and a model's node called by hand (`grad_fn`,
    saved in forward) is one node more than the model runs."""
    profiles = checks.profile_both(pool2, mutant(name), tmp_path / "profiles")
    with pytest.raises(AssertionError, match=message):
        checks.assert_overlap(profiles, "backward")


@pytest.mark.parametrize("name, check, message", [
    ("predivide", lambda pool3, pool2, impl, folder: checks.check_step(pool3, impl, "float32", "float32"),
     "differs"),
    ("no-reshard-after-forward", lambda pool3, pool2, impl, folder: checks.check_memory(pool2, impl, "float32", "float32"),
     "peak memory per step"),
    ("wait-prefetch-at-once", lambda pool3, pool2, impl, folder: checks.assert_overlap(
        checks.profile_both(pool2, impl, folder), "forward"), "not overlapped"),
])
def test_checks_fail_with_fsdp2_from_the_cache(mutant, pool2, pool3, tmp_path, monkeypatch, name, check, message):
    """FSDP2's side from a warm cache (fsdp2_cache) never turns a failing check into a pass."""
    monkeypatch.setenv("FSDP2_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FSDP2_CACHE", "on")
    trained, get = [], fsdp2_cache.get
    monkeypatch.setattr(fsdp2_cache, "get", lambda kind, parts, compute, outputs=None: get(
        kind, parts, lambda: trained.append(kind) or compute(), outputs))
    for run in ("cold", "warm"):
        with pytest.raises(AssertionError, match=message):
            check(pool3, pool2, mutant(name), tmp_path / run)
    assert len(trained) == 1, f"FSDP2 trained {trained}: the second run was not served from the cache"


def test_step_check_finds_blocks_kept_gathered_after_forward(mutant, pool2):
    """(Kept after backward: test_grading_mutants.test_step_checks_fail.)"""
    with pytest.raises(AssertionError, match="still alive after its forward"):
        checks.check_step(pool2, mutant("no-reshard-after-forward"), "float32", "float32")


@pytest.mark.parametrize("strip, fails, passes", [
    ({"task2"}, ["forward"], ["backward"]),
    ({"task3"}, ["backward"], ["forward"]),
    ({"task2", "task3"}, ["forward", "backward"], []),  # task 1 only
])
def test_overlap_check_fails_without_the_task(pool2, tmp_path, strip, fails, passes):
    """The reference without an overlap task fails that task's test and passes the other's."""
    variant = tmp_path / f"without_{'_'.join(sorted(strip))}.py"
    variant.write_text(make_skeleton.render(SOLUTION.read_text(), strip=strip))
    profiles = checks.profile_both(pool2, str(variant), tmp_path / "profiles")
    for which in fails:
        with pytest.raises(AssertionError, match="not overlapped"):
            checks.assert_overlap(profiles, which)
    for which in passes:
        checks.assert_overlap(profiles, which)


@pytest.mark.parametrize("name, fails, passes", [
    ("wait-prefetch-at-once", ["forward"], ["backward"]),
    ("blocking-all-gather", ["forward", "backward"], []),
    ("poll-all-gather-at-once", ["forward", "backward"], []),
    ("wait-work-at-once", ["forward", "backward"], []),
    ("prefetch-only-after-the-first-model", ["forward", "backward"], []),
    ("token-compute-forward", ["forward"], ["backward"]),
    ("token-compute-backward", ["backward"], ["forward"]),
])
def test_overlap_check_fails_when_waiting_at_once(mutant, pool2, tmp_path, name, fails, passes):
    """Overlap is judged by where the main thread waits: issuing early and waiting at once fails. In test.py's
    order (the check that the file is not FSDP2 first)."""
    checks.check_not_fsdp2(pool2, impl := mutant(name))
    profiles = checks.profile_both(pool2, impl, tmp_path / "profiles")
    for which in fails:
        with pytest.raises(AssertionError, match="not overlapped"):
            checks.assert_overlap(profiles, which)
    for which in passes:
        checks.assert_overlap(profiles, which)


def test_a_wait_method_kept_from_import_is_still_marked(mutant, pool2, tmp_path):
    """The gates (schedule's [Note: gates put in place before the file]): a file imported by an earlier job on the
    same ranks, with no marks on, kept Work.wait then and waits with it at once; a profiled run on those ranks
    still shows that wait (before the gates it did not, and every all-gather looked overlapped). On the same
    ranks on purpose: run_profiled gives effdl fresh ones, where the file is imported under the marks."""
    import dataclasses

    from harness.tools.grading.jobs import train_job
    from harness.tools.grading.policy import PROFILED, config
    from harness.tools.traces.analysis import analyze_run
    from harness.tools.traces.schedule import drawn_mark

    impl = mutant("wait-with-a-method-kept-from-import")
    checks.check_not_fsdp2(pool2, impl)  # imports the file on pool2's sandboxed ranks, outside any instrument
    cfg = dataclasses.replace(config(impl, **PROFILED), traces_dir=tmp_path / "traces", profile_memory=False)
    checks.run(pool2, train_job, cfg, False, mark := drawn_mark())
    stats = analyze_run(cfg.traces_dir, mark=mark)
    for phase in ("forward", "backward"):
        done, could, _ = stats.overlap("all_gather", phase)
        assert could and done == 0, (phase, done, could)


def test_overlap_check_fails_when_the_fsdp_runs_the_model(mutant, pool2, tmp_path):
    """Only the model's own run counts as compute: an FSDP that calls one of the model's modules itself
    (the root's norm once per forward) is told so, in both passes' checks."""
    profiles = checks.profile_both(pool2, mutant("extra-model-call"), tmp_path / "profiles")
    for which in ("forward", "backward"):
        with pytest.raises(AssertionError, match="an FSDP never calls the model's modules"):
            checks.assert_overlap(profiles, which)


def test_a_module_table_of_the_files_own_is_refused_where_it_is_set(mutant, pool2, tmp_path):
    """A block's norm called by the FSDP, its own later call hidden from the compute marks by a parameter table of
    the file's class (a dict subclass, past which marked_compute counts no compute): refused where the file sets the
    table (impl.py's [Note: a class the file mixes into a module]), before any run is profiled."""
    with pytest.raises(RankError, match="tables of parameters, buffers and submodules stay nn.Module's dicts"):
        checks.profile_both(pool2, mutant("token-call-unmarked-twin"), tmp_path / "profiles")


@pytest.mark.parametrize("bonus", ["bonus1", "bonus2", "bonus3"])
def test_bonus_check_fails_without_the_bonus(pool2, tmp_path, bonus):
    """The reference with one bonus region stripped breaks that bonus's promise, by name."""
    variant = tmp_path / f"without_{bonus}.py"
    variant.write_text(make_skeleton.render(SOLUTION.read_text(), strip={bonus}))
    with pytest.raises(AssertionError, match=rf"effdl breaks the promise of bonus {bonus[-1]}"):
        checks.check_mode(pool2, str(variant), [bonus], "float32", "float32", tmp_path / "run")


def test_bonus3_parity_fails_when_accumulating_in_the_compute_dtype(mutant, pool2, tmp_path):
    with pytest.raises(AssertionError, match="differ"):
        checks.check_mode(pool2, mutant("accumulate-in-compute-dtype"), ["bonus3"], "bfloat16", "float32", tmp_path)
