"""The full-precision warm-up under model.fit (workers/warmup.py, 2 ranks under horovodrun, AdamW): with the
defaults every method compresses once its warm-up is over, 1-bit Adam's warm-up follows the fit (or the learning
rate's warm-up) and is kept in model files, and a warm-up that covers a whole fit is said, before its first step
where the fit's length is known. Keras 3 (users' default) in the default run, tf_keras with --full."""
import pytest

from hvd_compress.adam import WARMUP_FRACTION
from hvdrun import KERASES, run_ranks

EPOCHS, STEPS = 8, 25  # workers/warmup.py's fit
#: The methods of the registry (hvd_compress.methods) under AdamW, and the fewest times fewer bytes than
#: uncompressed gradients each sends a step after its warm-up: 8, or what its defaults are made to send
#: (8 and 4 bits with a scale and an offset per 256 values, sketches at 4x).
AT_LEAST = {"onebit": 8, "onebit_oneway": 8, "quantize8": 3.5, "quantize4": 6, "topk": 8, "randomk": 8, "powersgd": 8,
            "sketch": 3.5, "fetchsgd": 3.5}
CASES = [f"defaults/{method}" for method in AT_LEAST] + ["schedule", "covers", "unknown_length"]


@pytest.fixture(scope="module", params=["keras3", pytest.param("tf_keras", marks=pytest.mark.full)])
def cases(request):
    ranks = run_ranks("warmup.py", f"--cases={','.join(CASES)}", np=2, env=KERASES[request.param], timeout=420)
    return ranks


def covering_warnings(lines):
    return [line for line in lines if "nothing is compressed" in line]


@pytest.mark.parametrize("method", AT_LEAST)
def test_every_method_compresses_after_its_default_warm_up(cases, method):
    """The last epoch's bytes per step (CompressionMetrics) at most 1/AT_LEAST of uncompressed gradients'; 1-bit
    Adam (onebit, sketch: momentum in front) warms up for 10% of the fit, and its config keeps that; the rest
    have none; nothing warned."""
    result = cases[0][f"defaults/{method}"]
    assert "refused" not in result, result
    print(f"{method}: {result['uncompressed_bytes'] / result['bytes_per_step'][-1]:.1f}x fewer bytes after a warm-up of "
          f"{result['warmup_steps']} steps")
    assert result["bytes_per_step"][-1] * AT_LEAST[method] <= result["uncompressed_bytes"], result["bytes_per_step"]
    one_bit_adam = method in ("onebit", "onebit_oneway", "sketch")
    planned = round(WARMUP_FRACTION * EPOCHS * STEPS)
    assert (result["warmup_steps"], result["saved_warmup_steps"]) == ((planned, planned) if one_bit_adam else (0, None))
    assert result["iterations"] == EPOCHS * STEPS
    assert not covering_warnings(result["logged"]), result["logged"]
    assert any(f"warms up for {planned} steps" in line for line in result["logged"]) == one_bit_adam


def test_a_learning_rate_warm_up_is_one_bit_adams(cases):
    result = cases[0]["schedule"]
    assert (result["warmup_steps"], result["saved_warmup_steps"]) == (7, 7)
    assert result["bytes_per_step"][-1] * 8 <= result["uncompressed_bytes"]


def test_a_warm_up_that_covers_the_fit_is_said_before_its_first_step(cases):
    """warmup_steps=1000 on a fit of 2 x 25 steps: said on rank 0, before the first batch, naming the argument;
    every step then sends full precision."""
    first, second = cases[0]["covers"], cases[1]["covers"]
    said = covering_warnings(first["before_first_step"])
    assert len(said) == 1 and "warmup_steps=" in said[0] and "ends at step 50" in said[0], first["before_first_step"]
    assert len(covering_warnings(first["logged"])) == 1  # said once, though two callbacks ask
    assert not covering_warnings(second["logged"])  # rank 0 says it
    assert first["bytes_per_step"][-1] == first["uncompressed_bytes"]


def test_a_fit_of_unknown_length_that_ended_inside_the_warm_up_is_said_after_it(cases):
    """10 batches from a generator (Keras 3 counts an 11th optimizer step at the end of such an epoch)."""
    result = cases[0]["unknown_length"]
    assert result["warmup_steps"] == 1000 and result["iterations"] >= 10  # 1 / (1 - beta_2): no length to follow
    assert not covering_warnings(result["before_first_step"])
    said = covering_warnings(result["logged"])
    assert len(said) == 1 and f"ended at step {result['iterations']}" in said[0], result["logged"]
