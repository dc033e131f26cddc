"""Test settings shared by every test module (environment set before TensorFlow loads), and the
digits runs that several modules compare with."""
import os

import pytest

from hvdrun import DIGITS_EPOCHS, run_ranks  # no TensorFlow loaded yet

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


@pytest.fixture(scope="session")
def digits_runs():
    """workers/train_digits.py on 2 ranks (Gloo, tf_keras) for DIGITS_EPOCHS, one launch for the
    suite: the uncompressed baseline, every compressor, onebit under Adam and SGP. Per rank,
    {run: results}."""
    runs = "none,onebit,onebit_oneway,topk,randomk,powersgd,sketch,onebit_adam,sgp"
    # Under pytest's 600 s per test, which counts this set-up in the first test that asks.
    ranks = run_ranks("train_digits.py", f"--runs={runs}", f"--epochs={DIGITS_EPOCHS}", np=2, timeout=540)
    return [r["results"] for r in ranks]
