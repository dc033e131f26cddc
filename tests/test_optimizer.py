"""hc.DistributedOptimizer under horovodrun: update rules, identical ranks, convergence, bad input."""
import pytest

from hvdrun import DIGITS_EPOCHS, KERASES, check_identical_per_world_size, check_sgp_next_to_allreduce, run_ranks


#: update_rule.py --rotation of each Keras's launch in the default run: each case runs at one of the world sizes 2
#: and 3 in one Keras and at the other size in the other, so every case meets both Kerases and both sizes, and each
#: Keras both sizes (every pair). --full runs every case at every size, 4 too.
ROTATION = {"tf_keras": 0, "keras3": 1}


@pytest.mark.parametrize("keras, world_sizes", [("tf_keras", [2, 3]), ("keras3", [2, 3]),
                                                pytest.param("tf_keras", [4], marks=pytest.mark.full),
                                                pytest.param("keras3", [4], marks=pytest.mark.full)])
def test_update_rules_match_the_numpy_reference_on_every_rank(keras, world_sizes, full_matrix):
    """onebit two-way (Nesterov, blocks), one-way, top-k, random-k, PowerSGD, sketch, the tape, quantize
    (its exchanged gradient bit for bit at 8, 4 and 2 bits) and 1-bit Adam and AdamW (bit for bit over the
    warm-up and the compressed steps; a variable without a gradient keeps its Adam slots),
    over 6 graph-mode steps with a learning-rate drop, in either Keras, equal the NumPy
    reference; all ranks end bit-identical. The world sizes of a launch run one after another
    on process sets of its ranks (rotated: ROTATION). Gloo only: the rules do not depend on the launcher, and the
    MPI launch is checked bit-identical after every step of a training run (below)."""
    rotation = [] if full_matrix or len(world_sizes) == 1 else [f"--rotation={ROTATION[keras]}"]
    results = run_ranks("update_rule.py", f"--world_sizes={','.join(map(str, world_sizes))}", *rotation,
                        np=max(world_sizes), env=KERASES[keras], timeout=420)
    check_identical_per_world_size(results, world_sizes)


@pytest.fixture(scope="module")
def digits_runs():
    """workers/train_digits.py on 2 ranks (Gloo, tf_keras) for DIGITS_EPOCHS, one launch for the
    module: the uncompressed baseline, every compressor (sketched SGD at 4x and 8x, FetchSGD at 4x), onebit under Adam
    and SGP. Per rank, {run: results}."""
    runs = ("none,onebit,onebit_oneway,quantize8,quantize4,topk,randomk,powersgd,sketch,sketch8,fetchsgd,adam,"
            "onebit_adam,sgp")
    # Under pytest's 600 s per test, which counts this set-up in the first test that asks.
    ranks = run_ranks("train_digits.py", f"--runs={runs}", f"--epochs={DIGITS_EPOCHS}", np=2, timeout=540)
    return [r["results"] for r in ranks]


#: Run (tests/workers/train_digits.py) -> (at least how many times fewer bytes than the baseline, at
#: most how many points of accuracy below it). Sketched SGD as the paper claims it: no loss at 4x,
#: about a point at 8x (held to 1.5; measured with hash seeds 0, 1, 2: +0.0 to +0.3 points at 4x,
#: +0.3 to +1.1 at 8x; applying only the exact top-k of the candidates, the paper's rule, it
#: diverged at 8x with seed 0: README, "Measured"). FetchSGD at 4x lost 0.0, 1.7 and 0.6 points
#: with seeds 0, 1, 2: held to 2.
CONVERGING = {"onebit": (8, 1), "onebit_oneway": (8, 1), "quantize8": (3.5, 0.3), "quantize4": (6, 1), "topk": (8, 1),
              "randomk": (8, 1), "powersgd": (4, 1), "sketch": (4, 0.5), "sketch8": (8, 1.5), "fetchsgd": (4, 2)}


@pytest.mark.parametrize("run", CONVERGING)
def test_training_converges_next_to_the_uncompressed_baseline(digits_runs, run):
    min_ratio, max_loss = CONVERGING[run]
    check_next_to_baseline([r[run] for r in digits_runs], digits_runs[0]["none"], min_ratio, run, max_loss)


@pytest.mark.parametrize("run, min_recall", [("sketch", 0.45), ("sketch8", 0.25)])
def test_sketched_sgd_logs_the_recall_of_the_true_top_k(digits_runs, run, min_recall):
    """CompressionMetrics(recall=True) on every epoch of the 2-rank digits runs: a fraction, the same on
    both ranks, and in the last epoch at least min_recall of the true top-k (k = d / (50 ratio); a
    random set of as many coordinates as it applies, 25 k, would hold 0.11 and 0.05). Measured with
    seeds 0-2: 0.57-0.62 at 4x and 0.34-0.37 at 8x; applying only the exact top-k of the candidates
    (the paper's rule) 0.22-0.24 and 0.11-0.14, and with the hashes fixed across steps 0.01-0.02
    (docs/algorithms.md, "Sketched SGD"), both of which fail here."""
    first, second = (r[run] for r in digits_runs)
    for key in ("recall", "captured_mass"):
        assert len(first[key]) == DIGITS_EPOCHS and all(0 <= v <= 1 for v in first[key]), (key, first[key])
        assert first[key] == second[key], key  # computed from allreduced values: alike on every rank
    assert first["recall"][-1] >= min_recall, first["recall"]


def test_sgp_trains_next_to_allreduce_sgd(digits_runs):
    """PushSumOptimizer on 2 ranks (3 ranks: test_gossip.py)."""
    check_sgp_next_to_allreduce(digits_runs)


@pytest.mark.full  # the default run's MPI training launch is Keras 3's (below): the launcher and the Keras meet nowhere
def test_mpi_training_converges_next_to_the_uncompressed_baseline(digits_runs):
    ranks = run_ranks("train_digits.py", "--runs=onebit", f"--epochs={DIGITS_EPOCHS}", np=2, launcher="mpi")
    check_next_to_baseline([r["results"]["onebit"] for r in ranks], digits_runs[0]["none"], 8, "onebit (mpi)")


@pytest.mark.parametrize("launcher", ["mpi", pytest.param("gloo", marks=pytest.mark.full)])
def test_keras3_training_converges_next_to_the_uncompressed_baseline(launcher):
    """Keras 3: onebit two-way next to Keras 3's uncompressed exchange (the same checks). Launched with MPI, it is
    also the default run's MPI training launch (tf_keras's, above, and this one on Gloo: --full)."""
    ranks = run_ranks("train_digits.py", "--runs=none,onebit", f"--epochs={DIGITS_EPOCHS}", np=2, launcher=launcher,
                      env=KERASES["keras3"])
    check_next_to_baseline([r["results"]["onebit"] for r in ranks], ranks[0]["results"]["none"], 8,
                           f"keras3 onebit ({launcher})")


def check_next_to_baseline(results, baseline, min_ratio, what, max_loss=1):
    """Accuracy at most max_loss points below the baseline's, with at least min_ratio times fewer
    bytes; every rank checked identical after every step."""
    ours = results[0]
    print(f"{what}: accuracy {ours['accuracy']:.4f} vs baseline {baseline['accuracy']:.4f}, "
          f"{ours['bytes_per_step']:.0f} vs {baseline['bytes_per_step']:.0f} bytes/step")
    assert ours["accuracy"] >= baseline["accuracy"] - max_loss / 100
    assert ours["bytes_per_step"] <= baseline["bytes_per_step"] / min_ratio
    assert ours["steps_checked"] == results[1]["steps_checked"] == DIGITS_EPOCHS * 22  # checked after every step
    assert all(r["digest"] == ours["digest"] for r in results)
    assert ours["logged_bytes"] == ours["bytes_per_step"] and ours["logged_residual_norm"] > 0


def test_four_ranks_stay_identical():
    """Bit-identical parameters after every step on 4 ranks, over 4 epochs. (The sketches' accuracy
    is held next to the baseline at 2 ranks and 16 epochs, above; here only identity.)"""
    epochs = 4
    ranks = run_ranks("train_digits.py", "--runs=onebit,sketch,fetchsgd", f"--epochs={epochs}", np=4)
    for run in ("onebit", "sketch", "fetchsgd"):
        results = [r["results"][run] for r in ranks]
        print(f"4 ranks {run}: accuracy {results[0]['accuracy']:.4f}")
        assert len({r["digest"] for r in results}) == 1, run
        assert all(r["steps_checked"] == epochs * 11 for r in results), run
    assert ranks[0]["results"]["onebit"]["accuracy"] > 0.85


def test_one_bit_adam_trains_as_adam_does(digits_runs):
    """onebit under Adam is 1-bit Adam (40 full-precision steps, then Adam's momentum in 1 bit with the
    variance frozen): within a point of uncompressed Adam, with 8x fewer bytes, identical ranks. (Sign
    compression of the gradient under Adam, what onebit did before, reached 0.88 against Adam's 0.95 after 8
    epochs.)"""
    adam, results = digits_runs[0]["adam"], [r["onebit_adam"] for r in digits_runs]
    print(f"digits, 2 ranks: 1-bit Adam {results[0]['accuracy']:.4f}, Adam {adam['accuracy']:.4f}")
    assert len({r["digest"] for r in results}) == 1
    assert results[0]["steps_checked"] == DIGITS_EPOCHS * 22
    assert results[0]["accuracy"] >= adam["accuracy"] - 0.01
    assert adam["bytes_per_step"] / results[0]["bytes_per_step"] >= 8


def test_a_non_finite_gradient_on_one_rank_reaches_every_rank():
    """Every rank's weights become non-finite (dist-EF-SGD's update), or every rank stops with
    hvd_compress's error (where the wrapped optimizer applies the exchanged gradient): never finite
    in silence, and the same on every rank. (Gloo: the MPI launch runs the same ops, and is checked
    in a training run above.)"""
    results = run_ranks("bad_input.py", "--mode=nan", np=2)
    assert results[0]["non_finite"] == results[1]["non_finite"]
    assert all(results[0]["non_finite"].values()), results[0]["non_finite"]
    assert results[0]["non_finite"]["topk"] == "raised"


def test_ranks_with_different_settings_fail_fast_with_a_clear_error():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks("bad_input.py", "--mode=mismatch", np=2, timeout=90)
    message = str(failure.value)
    assert "different compression settings" in message and "timed out" not in message
