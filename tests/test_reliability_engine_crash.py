"""Engine crash consistency: training processes SIGKILLed at random moments resume exactly.

tests/engine_crash_harness.py forks training children (engine.AdamW, everything on nvme; one
variant plain with a checkpoint directory per save, one with compressed optimizer state, gradient
accumulation, clipping and a checkpoint saved over with overwrite=True, one with the updates inside
backward, EngineConfig.step_in_backward) and kills them in forward,
in backward as a gradient offload starts, inside step() (at a pipeline event or a random delay),
inside a checkpoint save (at a filesystem call or a random delay), between steps and while resuming.
Each next child resumes from the store (EngineConfig(resume=True)) or from the latest checkpoint
(always after a kill in a save), and every loss it computes must equal an uninterrupted plain-torch
run's bit for bit. benchmarks/crash_bench.py --engine runs the same loop with --kills 200.
"""

from __future__ import annotations

import collections
import os
import signal

import engine_crash_harness as harness
import pytest
from engine_models import TinyGPT

import engine

KILLS = 14  # split over the two variants


@pytest.fixture(scope="module")
def forkserver():
    return harness.forkserver_context()


@pytest.mark.timeout(240)
def test_sigkilled_training_resumes_on_the_uninterrupted_loss_curve(tmp_path, forkserver):
    records = harness.run_engine_chains(str(tmp_path), KILLS, seed=9001, ctx=forkserver)
    killed = [r for r in records if r.killed]
    assert len(killed) == KILLS
    # The kills landed in the places they were aimed at, and the resumes did real work.
    in_flight = collections.Counter(r.in_flight for r in killed)
    assert in_flight["step"] >= 2 and in_flight["save"] >= 1, in_flight
    assert {r.source for r in records} >= {"store", "checkpoint"}, records
    assert sum(r.losses_checked for r in records) >= 40, records
    assert any(not r.killed for r in records), "no chain ran to its end (its final parameters are checked)"


@pytest.mark.timeout(180)
def test_sigkilled_updates_inside_backward_resume_on_the_uninterrupted_loss_curve(tmp_path, forkserver):
    """EngineConfig.step_in_backward: kills land among the updates backward runs (and anywhere else);
    each resume replays the interrupted step's batch."""
    records = harness.run_engine_chains(str(tmp_path), 10, seed=4242, variants=(harness.STEP_IN_BACKWARD,),
                                        ctx=forkserver, phases=("backward", "backward", "between", "resume"))
    killed = [r for r in records if r.killed]
    assert len(killed) == 10 and any(not r.killed for r in records)
    phases = collections.Counter(r.phase for r in killed)
    assert phases["backward"] >= 2 and phases["between"] >= 1, phases  # among the updates, and before the commit
    assert sum(r.losses_checked for r in records) >= 15, records


def test_the_checker_catches_a_wrong_loss_and_a_wrong_resume():
    variant = harness.VARIANTS[0]
    ref = {"losses": [[1.0], [2.0]], "crcs": [10, 11, 12]}
    state = harness.ChainState(store_steps={1}, ckpt_steps=set())
    ok = [{"resumed": 1, "source": "store", "crc": 11, "stale": []}, {"loss": 2.0, "s": 1, "m": 0}]
    rec = harness._check(ok, -9, state, ref, variant, "store", "t")
    assert rec.resumed_at == 1 and rec.losses_checked == 1
    with pytest.raises(harness.EngineCrashError, match="loss of step 1"):
        harness._check([ok[0], {"loss": 2.5, "s": 1, "m": 0}], -9, harness.ChainState({1}, set()), ref, variant,
                       "store", "t")
    with pytest.raises(harness.EngineCrashError, match="journals allow"):
        harness._check([dict(ok[0], resumed=0, crc=10)], -9, harness.ChainState({1}, set()), ref, variant, "store",
                       "t")
    with pytest.raises(harness.EngineCrashError, match="not the reference's"):
        harness._check([dict(ok[0], crc=99)], -9, harness.ChainState({1}, set()), ref, variant, "store", "t")
    with pytest.raises(harness.EngineCrashError, match="survived the resume"):
        harness._check([dict(ok[0], stale=["grad/x"])], -9, harness.ChainState({1}, set()), ref, variant, "store",
                       "t")
    # A step in flight at the kill: the next resume may find it committed, or not.
    state = harness.ChainState({1}, set())
    harness._check([ok[0], {"b": "opt", "s": 1}], -9, state, ref, variant, "store", "t")
    assert state.store_steps == {1, 2}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rename", [0, 1])
def test_a_kill_in_an_overwriting_save_leaves_the_previous_checkpoint_loadable(tmp_path, forkserver, rename):
    """Killed before the first rename (<dir> still the old one) or between the two (only <dir>.old,
    complete): <dir> loads as the previous checkpoint and the next save over it works."""
    ckpt = str(tmp_path / "ckpt")
    child = forkserver.Process(target=harness.overwrite_and_die, args=(str(tmp_path / "s"), ckpt, "os.rename", rename))
    child.start()
    child.join(harness.PATIENCE_S)
    assert child.exitcode == -signal.SIGKILL
    assert os.path.exists(ckpt + ".partial") and os.path.exists(ckpt) == (rename == 0)
    ref = harness.reference(harness.VARIANTS[0], str(tmp_path), forkserver)
    config = harness.engine_config(str(tmp_path / "s2"), harness.VARIANTS[0], resume=False)
    with engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=harness.LR), config=config) as eng:
        eng.load_checkpoint(ckpt)
        assert eng.completed_steps == 1
        assert harness.params_crc(eng.state_dict()) == ref["crcs"][1]
        eng.save_checkpoint(ckpt, overwrite=True)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ckpt.")]
