"""Accordion (hvd_compress/accordion.py, callbacks.Accordion/AccordionBatchSize)."""
import numpy as np
import pytest

import hvd_compress as hc
from hvd_compress.accordion import AdaptiveCompression, RegimeDetector, critical_regime
from hvdrun import KERASES, run_hosts, run_ranks


def test_a_layer_is_critical_when_its_norm_changes_by_eta_or_the_rate_drops():
    previous, now = [10.0, 10.0, 10.0, 0.0], [14.9, 5.0, 16.0, 3.0]
    np.testing.assert_array_equal(critical_regime(previous, now, 0.5), [False, True, True, True])
    np.testing.assert_array_equal(critical_regime(previous, now, 0.5, learning_rate_dropped=True), [True] * 4)
    np.testing.assert_array_equal(critical_regime([2.0], [np.nan], 0.5), [True])


@pytest.mark.parametrize("low, high, match", [
    (hc.Compression.topk(ratio=0.1), hc.Compression.powersgd(rank=1), "same compressor family"),
    (hc.Compression.none, hc.Compression.fp16, "stateful"),
    (hc.Compression.fp16, hc.Compression.onebit(), "same compressor family"),
])
def test_settings_of_different_families_are_refused(low, high, match):
    with pytest.raises(TypeError, match=match):
        hc.callbacks.Accordion(low=low, high=high)


@pytest.mark.parametrize("kwargs, match", [
    (dict(eta=0), "eta must be a positive number"),
    (dict(interval=0), "interval must be 'epoch' or a number of steps"),
    (dict(interval="batch"), "interval must be 'epoch' or a number of steps"),
])
def test_bad_detector_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hc.callbacks.Accordion(low=hc.Compression.powersgd(rank=4), high=hc.Compression.powersgd(rank=1),
                               **kwargs)


@pytest.mark.parametrize("small, large", [(8, 12), (8, 8), (0, 8), (8, 32.0)])
def test_batch_sizes_must_be_multiples(small, large):
    with pytest.raises(ValueError, match="small|large"):
        hc.callbacks.AccordionBatchSize(small, large)


def test_the_low_setting_may_be_uncompressed():
    adaptive = AdaptiveCompression(hc.Compression.none, hc.Compression.onebit())
    assert adaptive.settings[0] is None and "Compression.none" in repr(adaptive)


def test_adaptive_compression_needs_the_regime_of_every_variable():
    exchange = hc.GradientExchange(hc.Compression.onebit())
    with pytest.raises(ValueError, match="groups='variable'"):
        exchange.use_accordion(AdaptiveCompression(hc.Compression.none, hc.Compression.onebit()),
                               RegimeDetector(groups="model"))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """Where the checkpoint check's uninterrupted run saves, for the resumed run."""
    return tmp_path_factory.mktemp("accordion")


@pytest.fixture(scope="module")
def tf_keras_checks(checkpoint_dir):
    """workers/accordion.py's rules, fit and batch checks, and the checkpoint check's uninterrupted run, in one
    tf_keras launch on 2 ranks: per-rank {check: results}."""
    return run_ranks("accordion.py", "--checks=rules,fit,batch,checkpoint", "--phase=full",
                     f"--work_dir={checkpoint_dir}", np=2, timeout=400, env=KERASES["tf_keras"])


def test_switching_keeps_error_feedback_and_matches_numpy(tf_keras_checks):
    """Forced switches every step or two: onebit <-> none (dist-EF-SGD), PowerSGD rank 3 <-> 1,
    top-k 20% <-> 2%, against NumPy; the step is traced once."""
    assert all(r["rules"]["digests"] == tf_keras_checks[0]["rules"]["digests"] for r in tf_keras_checks)


@pytest.mark.parametrize("keras", list(KERASES), ids=["tf_keras-2ranks", "keras3-2x2hierarchical"])
def test_callback_decides_alike_on_every_rank_without_retracing(keras, request):
    """tf_keras on 2 ranks; Keras 3 on 2 hosts of 2 ranks, hierarchical=True (each layer's PowerSGD settings across
    hosts, by one rank of the host in turn)."""
    if keras == "tf_keras":
        ranks = request.getfixturevalue("tf_keras_checks")
    else:
        ranks = run_hosts("accordion.py", "--checks=fit", "--hierarchical_exchange", ranks_per_host=(2, 2), env=KERASES[keras],
                          timeout=400)
    results = [r["fit"] for r in ranks]
    first = results[0]
    assert all(r["model"] == first["model"] and r["decisions"] == first["decisions"] for r in results)
    assert first["traces"] == 1
    regimes = [d["critical"] for d in first["decisions"]]
    assert len(regimes) == 5 * first["steps_per_epoch"] // 7  # a decision every 7 steps
    assert any(all(c) for c in regimes) and any(not any(c) for c in regimes)  # both settings were used
    # The learning-rate drop before epoch 4 makes every layer critical at the first decision after it.
    after_drop = next(d for d in first["decisions"] if d["step"] > 4 * first["steps_per_epoch"])
    assert all(after_drop["critical"])
    # Cumulative bytes: each interval's steps at the setting it ran with (the first one low).
    logs, total, start, choice = first["logs"], 0.0, 0, [True, True]
    for end, critical in [(d["step"], d["critical"]) for d in first["decisions"]] + [(5 * first["steps_per_epoch"],
                                                                                     None)]:
        per_step = first["dense_bytes"] + sum(b[0] if c else b[1] for b, c in zip(first["bytes_by_setting"], choice))
        total, start, choice = total + (end - start) * per_step, end, critical
    assert logs["cumulative_bytes"][-1] == pytest.approx(total)
    if first["cross_host_bytes_by_setting"] is None:
        assert logs["cumulative_bytes"][-1] < 5 * first["steps_per_epoch"] * first["uncompressed_bytes"] / 4
    else:  # what host 0's ranks send to the other host at the high setting (a rank's own bytes hold the host's)
        across = sum(b[1] for rank in results[:2] for b in rank["cross_host_bytes_by_setting"])
        assert 0 < across < first["uncompressed_bytes"] / 4
    assert "bytes_per_step" in logs
    for layer in ("conv2d_1/kernel", "dense/kernel"):  # Keras 3 names them by path: sequential/dense/kernel
        assert any(key.startswith("accordion_critical/") and key.endswith(f"/{layer}") for key in logs), layer


def test_batch_size_variant_follows_the_linear_rule_and_switches(tf_keras_checks):
    results = [r["batch"] for r in tf_keras_checks]
    first = results[0]
    assert all(r["model"] == first["model"] and r["decisions"] == first["decisions"] for r in results)
    assert first["traces"] == 1
    batch_sizes = first["logs"]["batch_size"]
    assert set(batch_sizes) == {8.0, 32.0}  # both regimes were used
    assert batch_sizes[5] == 8.0  # the learning-rate drop before epoch 5 makes it critical
    # An optimizer step per batch of 8 in critical epochs, per 4 of them otherwise.
    steps = first["steps_per_epoch"]
    assert first["iterations"] == sum(steps if b == 8 else steps // 4 for b in batch_sizes)


def test_resume_keeps_the_detector_history_and_choices(tf_keras_checks, checkpoint_dir):
    """The resumed run sees the rate drop (its last rate comes from the checkpoint), decides
    as the uninterrupted run did and ends with the same parameters and state."""
    full = [r["checkpoint"] for r in tf_keras_checks]
    resumed = [r["checkpoint"] for r in run_ranks("accordion.py", "--checks=checkpoint", "--phase=resume",
                                                  f"--work_dir={checkpoint_dir}", np=2,
                                                  env=KERASES["tf_keras"])]
    for before, after in zip(full, resumed):
        assert after == before
    assert all(full[0]["decisions"][0]["critical"])  # the drop at epoch 3


@pytest.mark.full
def test_accordion_trains_as_well_as_static_low_compression_with_fewer_bytes():
    """examples/keras_accordion.py, PowerSGD rank 4 <-> 1 on 2 ranks, same seeds and epochs: on the
    mean of 3 seeds within 1 point (one run alone moves by about a point: 360 test images); the
    issue's 0.5 point is checked by benchmarks/accordion.py."""
    seeds = range(3)
    everything = run_ranks("accordion_digits.py", "--modes=low,accordion", f"--seeds={','.join(map(str, seeds))}",
                           np=2, timeout=600)[0]
    runs = {mode: [everything[f"{mode}/{seed}"] for seed in seeds] for mode in ("low", "accordion")}
    low, adaptive = (np.mean([r["test_accuracy"] for r in runs[mode]]) for mode in ("low", "accordion"))
    assert adaptive >= low - 0.01, (adaptive, low)
    for low_run, adaptive_run in zip(runs["low"], runs["accordion"]):
        assert adaptive_run["total_bytes"] <= 0.6 * low_run["total_bytes"]
        regimes = [e["accordion_critical/dense/kernel"] for e in adaptive_run["epochs"]]
        assert regimes[0] == 1.0 and 0.0 in regimes  # starts critical, then compresses more
