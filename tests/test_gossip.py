"""Stochastic Gradient Push under horovodrun: consensus, conserved mass, training."""
import numpy as np
import pytest

from hvdrun import run_ranks


@pytest.mark.parametrize("np_, flags", [
    (2, ["--graph=exponential"]), (3, ["--graph=exponential"]), (3, ["--graph=ring"]),
    (4, ["--graph=exponential2"]), (4, ["--graph=exponential", "--overlap"]),
])
def test_gossip_without_gradients_reaches_the_exact_average(np_, flags):
    results = run_ranks("gossip_consensus.py", *flags, "--steps=40", np=np_)
    for r in results:
        errors = np.array(r["errors"])
        assert errors[-1] < 1e-3, errors  # consensus on the exact average (float32)
        assert errors[-1] <= errors[0] / 100  # (2 ranks: exact after the first step)
        np.testing.assert_allclose(r["mass"], np_, rtol=1e-6)  # sum of weights (+ in flight) is n
    if "--overlap" not in flags:  # geometric decrease, checked over windows of the schedule
        window = np.array(results[0]["errors"][:20]).reshape(5, 4).max(axis=1)
        assert np.all((window[1:] <= window[:-1] * 0.9) | (window[1:] < 1e-5)), window


@pytest.mark.parametrize("flags", [[], ["--overlap"]])
def test_average_every_h_steps_is_exact_consensus(flags):
    """3 ranks on a ring mix slowly; every 4th step an exact average (mass in flight included)."""
    results = run_ranks("gossip_consensus.py", "--graph=ring", "--average_every=4", "--steps=8", *flags, np=3)
    for r in results:
        errors = r["errors"]
        assert errors[2] > 1e-2  # gossip alone is not there yet...
        assert errors[3] < 1e-5 and errors[7] < 1e-5  # ...the average after steps 4 and 8 is
        np.testing.assert_allclose(r["mass"], 3, rtol=1e-6)


@pytest.mark.parametrize("np_", [2, 3])  # 3: peers 1 and 2 in turn, as at 4 (gossip at 4 ranks: above)
def test_sgp_trains_next_to_allreduce_sgd(np_):
    baseline = run_ranks("train_digits.py", "--compression=none", "--epochs=16", np=np_)[0]
    results = run_ranks("train_gossip.py", "--epochs=16", np=np_)
    ours = results[0]
    print(f"{np_} ranks: SGP consensus {ours['accuracy']:.4f} vs allreduce {baseline['accuracy']:.4f}, "
          f"spread per epoch {ours['spread']}")
    assert ours["accuracy"] >= baseline["accuracy"] - 0.01
    assert all(r["after"] == 0.0 for r in results)  # the consensus model is the same everywhere
    assert ours["bytes_sent"] == 4 * (21546 + 1)  # one peer: d floats and the weight
