"""Stochastic Gradient Push under horovodrun: consensus, conserved mass, training."""
import re

import numpy as np
import pytest

from hvdrun import DIGITS_EPOCHS, KERASES, check_sgp_next_to_allreduce, run_failing, run_ranks

#: Cases (tests/workers/gossip_consensus.py) with an exact average every 4th step, at 3 ranks.
AVERAGE_EVERY_4 = ["ring+every4", "ring+every4+overlap"]
#: World size -> its cases, all in one launch at the largest, each size on the process set of ranks 0..n-1.
CONSENSUS = {2: ["exponential"], 3: ["exponential", "ring", *AVERAGE_EVERY_4],
             4: ["exponential2", "exponential+overlap"]}


@pytest.fixture(scope="module")
def consensus():
    """{n: {case: per-rank results}} of CONSENSUS's launch."""
    launched = [f"{n}/{case}" for n, cases in CONSENSUS.items() for case in cases]
    ranks = run_ranks("gossip_consensus.py", f"--cases={','.join(launched)}", np=max(CONSENSUS))
    return {n: {case: [r["results"][f"{n}/{case}"] for r in ranks[:n]] for case in cases}
            for n, cases in CONSENSUS.items()}


@pytest.mark.parametrize("n", list(CONSENSUS))
def test_gossip_without_gradients_reaches_the_exact_average(consensus, n):
    for case, results in consensus[n].items():
        if case in AVERAGE_EVERY_4:
            continue
        for r in results:
            errors = np.array(r["errors"])
            assert errors[-1] < 1e-3, (case, errors)  # consensus on the exact average (float32)
            assert errors[-1] <= errors[0] / 100, case  # (2 ranks: exact after the first step)
            np.testing.assert_allclose(r["mass"], len(results), rtol=1e-6)  # sum of weights (+ in flight) is n
        if "overlap" not in case:  # geometric decrease, checked over windows of the schedule
            window = np.array(results[0]["errors"][:20]).reshape(5, 4).max(axis=1)
            assert np.all((window[1:] <= window[:-1] * 0.9) | (window[1:] < 1e-5)), (case, window)


def test_average_every_h_steps_is_exact_consensus(consensus):
    """3 ranks on a ring mix slowly; every 4th step an exact average (mass in flight included)."""
    for case in AVERAGE_EVERY_4:
        for r in consensus[3][case]:
            errors = r["errors"]
            assert errors[2] > 1e-2, case  # gossip alone is not there yet...
            assert errors[3] < 1e-5 and errors[7] < 1e-5, case  # ...the average after steps 4 and 8 is
            np.testing.assert_allclose(r["mass"], 3, rtol=1e-6)


def test_sgp_trains_next_to_allreduce_sgd_at_3_ranks():
    """3 ranks: peers 1 and 2 in turn, as at 4 (gossip at 4 ranks: above; 2 ranks: with every
    method in test_optimizer.py)."""
    ranks = [r["results"] for r in run_ranks("train_digits.py", "--runs=none,sgp", f"--epochs={DIGITS_EPOCHS}",
                                              np=3, timeout=400)]
    check_sgp_next_to_allreduce(ranks)


@pytest.mark.parametrize("ranks", [5, pytest.param(2, marks=pytest.mark.full)])
def test_pushsum_matches_the_numpy_reference_over_alltoall_and_point_to_point(ranks, full_matrix):
    """PushSum with messages mixed in at once (tau = 0) or a step later (overlap, tau = 1), with an exact average
    every 4th step, wrapping SGD and (with overlap) AdamW, against NumPy on every rank
    (tests/workers/gossip_rule.py): over alltoall at each world size, over MPI's point-to-point transport (an MPI
    launch) at the launch's, with the alltoall run's bits; the weights and the mass in flight sum to n. One 5-rank
    launch: world sizes 2, 3 and 5, at 2 and 3 the cases in which every graph, overlap and average setting meets
    each; --full: every case at 2 to 5, and MPI at 2 in a launch of 2."""
    world_sizes = [2] if ranks == 2 else [2, 3, 4, 5] if full_matrix else [2, 3, 5]
    results = run_ranks("gossip_rule.py", f"--world_sizes={','.join(map(str, world_sizes))}",
                        *(["--every_case_at_every_size"] if full_matrix else []), np=ranks, launcher="mpi",
                        timeout=300)
    assert {name.split("/")[1] for name in results[0]["digests"]} == {"alltoall", "mpi"}
    assert {int(name.split("/")[0]) for name in results[0]["digests"]} == set(world_sizes)


def test_point_to_point_gossip_under_gloo_is_refused_with_the_launch_to_use():
    results = run_ranks("gossip_rule.py", "--refused", np=2, launcher="gloo")
    for r in results:
        assert "horovodrun --mpi" in r["refused"] and "transport='alltoall'" in r["refused"], r


@pytest.mark.parametrize("fail", ["exit", "hang"])
def test_a_rank_that_dies_or_hangs_mid_gossip_ends_the_job_with_an_error(fail):
    """Point-to-point gossip at 3 ranks; rank 1 exits, or hangs, at step 3 (tests/workers/gossip_failure.py): the job
    ends with an error within the launch's timeout; the peers of a hung rank say what they waited for."""
    output = run_failing("gossip_failure.py", f"--fail={fail}", np=3, launcher="mpi", timeout=150)
    if fail == "exit":
        assert re.search(r"Exit code:\s+3", output), output[-3000:]  # mpirun names the rank that left
    else:  # the peers time out, then abort the job (MPI_Finalize would wait for the hung rank); not asserted:
        # mpirun's own "MPI_ABORT was invoked" text, which Open MPI garbles when two ranks abort at once
        assert "did not arrive within 10 s" in output and "aborting the MPI job (MPI_Abort)" in output, output[-3000:]


def test_max_drift_bounds_how_far_ranks_run_ahead_of_a_straggler():
    """7 ranks on a ring over MPI with overlap, rank 1 sleeping 0.2 s before every step: the graph alone lets a rank
    run further ahead the more hops it is from the straggler; max_drift=1 holds every rank within 1 + 2 steps of it
    (its step t completes once every rank posted t - 1, and with overlap it collects t - 1 in step t), and changes
    no bit."""
    ranks = [r["results"] for r in run_ranks("gossip_drift.py", "--cases=none,1", np=7, launcher="mpi", timeout=300)]

    def lead(case):  # the most steps any rank had ended beyond the straggler's at any of its own step ends
        ended = [np.array(r[case]["ended"]) for r in ranks]
        return max(int(np.sum(mine <= t) - np.sum(ended[1] <= t)) for mine in ended for t in mine)

    assert lead("1") <= 1 + 2, lead("1")
    assert lead("none") > 1 + 2, lead("none")  # (else this setting would not show the bound)
    for r in ranks:
        assert r["none"]["digest"] == r["1"]["digest"]


@pytest.mark.parametrize("keras", ["keras3", pytest.param("tf_keras", marks=pytest.mark.full)])
def test_consensus_callback_averages_the_ranks_at_fit_end_and_before_each_validation(keras):
    """model.fit under an MPI launch at 3 ranks: SGP over point-to-point gossip with overlap (wrapping SGD with
    momentum, and AdamW), validation data,
    hc.callbacks.Consensus, then what users put after it (a rank-0 ModelCheckpoint, EarlyStopping)."""
    ranks = [r["results"] for r in run_ranks("sgp_fit.py", np=3, launcher="mpi", timeout=300, env=KERASES[keras])]
    for case in ("final", "every_epoch"):
        per_rank = [r[case] for r in ranks]
        assert len({r["after_fit"] for r in per_rank}) == 1, case  # one model after fit
        assert {len(r["at_epoch_end"]) for r in per_rank} == {2}, case  # EarlyStopping stopped every rank there
        for epoch in range(2):
            validated = {r["at_validation"][epoch] for r in per_rank}
            ended = {r["at_epoch_end"][epoch] for r in per_rank}
            losses = {r["val_loss"][epoch] for r in per_rank}
            if case == "every_epoch":  # validation, and every callback after Consensus, see the average
                assert len(validated) == len(ended) == len(losses) == 1, (case, epoch)
            else:  # each rank validates its own model
                assert len(validated) == len(ended) == 3, (case, epoch)
    assert all(r["every_epoch"]["saved_is_final"] for r in ranks)  # rank 0's file holds the average
    assert ranks[0]["every_epoch"]["val_loss"][-1] < ranks[0]["every_epoch"]["val_loss"][0]  # it trains
