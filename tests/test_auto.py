"""Compression.auto() (hvd_compress/auto.py): its choice from given measurements, its refusals, and model.fit under
horovodrun in both Kerases, where it calibrates, decides alike on every rank, switches, and is saved in model files."""
import pytest

import hvd_compress as hc
from hvd_compress import auto, cost
from hvdrun import KERASES, run_ranks


def test_bad_settings_are_refused_before_any_step():
    with pytest.raises(ValueError, match="methods="):
        hc.Compression.auto(methods=["onebit", "zip"])
    with pytest.raises(ValueError, match="calibration_steps="):
        hc.Compression.auto(calibration_steps=1)
    with pytest.raises(ValueError, match="link rate"):
        hc.Compression.auto(link="fast")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_choice_follows_the_link(kind):
    """From the same measurements (25M MLP, a 300 ms step at full precision on 2 ranks): a 1 Gbit/s link's 100 MB
    allreduce takes most of the step, and a low-risk compression is chosen; on a link so fast that the allreduce is
    nothing, full precision is kept."""
    optimizer = cost.keras_optimizer(kind)
    chooser = hc.Compression.auto()
    elements = sum(s[0] * (s[1] if len(s) > 1 else 1) for s in cost.MLP25M_SHAPES)
    probe = cost.published_cpu(kind).probe_s  # (the published machine's own speed: its costs unscaled)
    slow = chooser.choose(optimizer, cost.MLP25M_SHAPES, 1.0, 0.8, 0.8 / 16 + 1e-3, 2, probe)[0]
    assert slow["method"] == ("onebit" if kind == "adamw" else slow["method"]) and slow["method"] != "none", slow
    fast = chooser.choose(optimizer, cost.MLP25M_SHAPES, 0.3, 4 * elements * 8 / 1e13, 1e-6, 2, probe)[0]
    if kind == "sgd":
        assert fast["method"] == "none" and "full precision" in fast["why"] and "measured" in fast["why"], fast
    else:  # 1-bit Adam's step in fused kernels is shorter than Keras's AdamW even where nothing is sent
        assert fast["method"] == "onebit", fast


def test_the_calibration_counts_the_steps_it_timed_whatever_step_it_starts_from():
    """A restored optimizer starts past calibration_steps: auto still times its calibration_steps steps first (it
    decided at once on no timed step before)."""
    chooser = hc.Compression.auto(calibration_steps=3)
    for step in range(1000, 1003):
        assert not chooser.due()
        chooser.batch_begins(step)
        chooser.batch_ends(step + 1)
    assert chooser.due()


def test_the_link_is_fitted_from_two_allreduces():
    link = auto.fitted_link(16e6, 0.128 + 0.002, 1e6, 0.008 + 0.002, 2)  # 1 Gbit/s, 1 ms a round
    assert link.rate_bps == pytest.approx(1e9, rel=1e-6) and link.latency_s == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("keras,loader,np", [("keras3", "hc", 2), ("tf_keras", "keras", 3)])
def test_auto_in_model_fit_decides_alike_switches_and_is_saved(keras, loader, np):
    """tests/workers/auto_fit.py: on a given slow link (AdamW, and under mixed_float16) auto compresses, on a given fast one (SGD) it keeps full
    precision, on the measured loopback every rank takes the same choice; the ranks stay bit-identical, training goes
    on after the switch, and rank 0's .keras file holds the choice on every rank that loads it; a custom loop through
    Compression.auto().train_step decides as model.fit does, and its step traced before the decision fails with the fix
    if it runs after it, changing nothing."""
    ranks = [r["results"] for r in run_ranks("auto_fit.py", f"--loader={loader}", np=np, timeout=300,
                                             env=KERASES[keras])]
    for case in ("slow", "fast", "measured", "mixed", "loop"):
        ours = [r[case] for r in ranks]
        print(f"{keras} {np} ranks {case}: {ours[0]['decision']}, bytes {ours[0]['bytes_before']:.0f} -> "
              f"{ours[0]['bytes_after']:.0f}, loss {ours[0]['loss'][0]:.3f} -> {ours[0]['loss'][-1]:.3f} -> "
              f"{ours[0].get('resumed_loss', float('nan')):.3f}, accuracy {ours[0]['accuracy']:.4f}; {ours[0]['logged']}")
        assert len({r["decision"] for r in ours}) == 1 and ours[0]["decision"] is not None, case
        assert len({r["digest"] for r in ours}) == 1, case
        assert len(ours[0]["logged"]) == 1 and not any(r["logged"] for r in ours[1:]), case  # rank 0 says why
        assert ours[0]["bytes_before"] == ours[0]["allreduce_bytes"], case  # the calibration: full precision
        if case == "measured":  # whatever it chose trains on: top-k 1%, chosen on a loaded machine at 3 ranks, took
            # the loss from 2.25 to 1.34 in these few steps (accuracy 0.75), then to 0.59 in one more epoch
            assert ours[0]["loss"][-1] < 0.75 * ours[0]["loss"][0] and ours[0]["accuracy"] > 0.5, case
        else:
            assert ours[0]["loss"][-1] < ours[0]["loss"][0] / 2 and ours[0]["accuracy"] > 0.8, case
        if ours[0]["decision"] == "none":
            assert ours[0]["bytes_after"] == ours[0]["allreduce_bytes"], case
        else:
            assert ours[0]["bytes_after"] <= ours[0]["allreduce_bytes"] / 8, case
            assert all(r["compression"] != "AutoCompression" for r in ours), case
        if case == "loop":  # (a custom loop: no model file) its step traced before the decision is refused
            assert all("has chosen its compression since this step was traced" in r["stale"]["message"]
                       and r["stale"]["unchanged"] for r in ours), [r["stale"] for r in ours]
            continue
        assert len({r["resumed_digest"] for r in ours}) == 1, case
        assert ours[0]["resumed_loss"] <= ours[0]["loss"][-1] * 1.2, case  # the loaded file trains on
        assert all(not r["loaded_auto"] for r in ours), case  # the file holds the choice, not auto
        assert all(r["compression"] == r["loaded_compression"] for r in ours), case
    assert ranks[0]["slow"]["decision"] == ranks[0]["mixed"]["decision"] == ranks[0]["loop"]["decision"] == "onebit"
    assert ranks[0]["fast"]["decision"] == "none"
