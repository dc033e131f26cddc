"""hc.DistributedOptimizer under horovodrun: update rules, identical ranks, convergence, bad input."""
import pytest

from hvdrun import KERASES, run_ranks

EPOCHS = 16


@pytest.mark.parametrize("launcher, np, keras", [("gloo", 2, "tf_keras"), ("gloo", 3, "tf_keras"),
                                                ("gloo", 4, "tf_keras"), ("mpi", 2, "tf_keras"),
                                                ("gloo", 3, "keras3"), ("mpi", 2, "keras3")])
def test_update_rules_match_the_numpy_reference_on_every_rank(launcher, np, keras):
    """onebit two-way (Nesterov, blocks), one-way, top-k, random-k, PowerSGD, sketch and the tape,
    over 6 graph-mode steps with a learning-rate drop, in either Keras, equal the NumPy
    reference; all ranks end bit-identical."""
    results = run_ranks("update_rule.py", np=np, launcher=launcher, env=KERASES[keras])
    assert all(r["digests"] == results[0]["digests"] for r in results)


@pytest.fixture(scope="module")
def baseline():
    results = run_ranks("train_digits.py", "--compression=none", f"--epochs={EPOCHS}", np=2)
    return results[0]


@pytest.mark.parametrize("flags, launcher, min_ratio", [
    (["--compression=onebit", "--two_way"], "gloo", 8),
    (["--compression=onebit", "--notwo_way"], "gloo", 8),
    (["--compression=topk", "--ratio=0.01"], "gloo", 8),
    (["--compression=randomk", "--ratio=0.1"], "gloo", 8),
    # >= 4x of all bytes, biases included. Sketched SGD's recovery finds no heavy hitters yet (it
    # behaves like random-k; its rewrite is planned): 0.961 against 0.978 since the broadcast fix.
    pytest.param(["--compression=sketch", "--sketch_ratio=4.5"], "gloo", 4,
                 marks=pytest.mark.xfail(reason="sketch recovery: heavy hitters not found yet")),
    (["--compression=powersgd"], "gloo", 4),
    (["--compression=onebit", "--two_way"], "mpi", 8),
])
def test_training_converges_next_to_the_uncompressed_baseline(baseline, flags, launcher, min_ratio):
    results = run_ranks("train_digits.py", *flags, f"--epochs={EPOCHS}", np=2, launcher=launcher)
    check_next_to_baseline(results, baseline, min_ratio, f"{flags} {launcher}")


def test_keras3_training_converges_next_to_the_uncompressed_baseline():
    """Keras 3: onebit two-way next to Keras 3's uncompressed exchange (the same checks)."""
    env = KERASES["keras3"]
    baseline = run_ranks("train_digits.py", "--compression=none", f"--epochs={EPOCHS}", np=2, env=env)[0]
    results = run_ranks("train_digits.py", "--compression=onebit", "--two_way", f"--epochs={EPOCHS}", np=2, env=env)
    check_next_to_baseline(results, baseline, 8, "keras3 onebit")


def check_next_to_baseline(results, baseline, min_ratio, what):
    ours = results[0]
    print(f"{what}: accuracy {ours['accuracy']:.4f} vs baseline {baseline['accuracy']:.4f}, "
          f"{ours['bytes_per_step']:.0f} vs {baseline['bytes_per_step']:.0f} bytes/step")
    assert ours["accuracy"] >= baseline["accuracy"] - 0.01
    assert ours["bytes_per_step"] <= baseline["bytes_per_step"] / min_ratio
    assert ours["steps_checked"] == results[1]["steps_checked"] > 100  # checked after every step
    assert all(r["digest"] == ours["digest"] for r in results)
    assert ours["logged_bytes"] == ours["bytes_per_step"] and ours["logged_residual_norm"] > 0


@pytest.mark.parametrize("compression, epochs, min_accuracy", [("onebit", 8, 0.9), ("sketch", 2, None)])
def test_four_ranks_stay_identical(compression, epochs, min_accuracy):
    """Bit-identical parameters after every step on 4 ranks. (Sketched SGD at 4 ranks and lr 0.2 does
    not converge on digits: its byte budget buys few coordinates per step on a 21k model; see
    docs/design.md. Only identity is asserted for it.)"""
    results = run_ranks("train_digits.py", f"--compression={compression}", f"--epochs={epochs}", np=4)
    print(f"4 ranks {compression}: accuracy {results[0]['accuracy']:.4f}")
    assert len({r["digest"] for r in results}) == 1
    assert all(r["steps_checked"] == epochs * 11 for r in results)
    if min_accuracy:
        assert results[0]["accuracy"] > min_accuracy


def test_plain_error_feedback_under_adam():
    """Not dist-EF-SGD (that is for momentum SGD): EF on gradients, Adam on the mean. It learns,
    more slowly than Adam itself (measured: 0.88 vs 0.95 after 8 epochs)."""
    results = run_ranks("train_digits.py", "--compression=onebit", "--optimizer=adam", "--epochs=8", np=2)
    assert len({r["digest"] for r in results}) == 1
    assert results[0]["accuracy"] > 0.8


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_a_non_finite_gradient_on_one_rank_reaches_every_rank(launcher):
    results = run_ranks("bad_input.py", "--mode=nan", np=2, launcher=launcher)
    assert results[0]["non_finite"] == results[1]["non_finite"]
    assert all(results[0]["non_finite"].values()), results[0]["non_finite"]


def test_ranks_with_different_settings_fail_fast_with_a_clear_error():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks("bad_input.py", "--mode=mismatch", np=2, timeout=90)
    message = str(failure.value)
    assert "different compression settings" in message and "timed out" not in message
