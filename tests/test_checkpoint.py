"""Error-feedback state survives checkpoints: resuming in a new process continues exactly."""
import os
import subprocess
import sys

import pytest

from hvdrun import run_ranks


@pytest.mark.parametrize("save_format, compression", [
    ("checkpoint", "onebit"), ("h5", "onebit"), ("savedmodel", "onebit"), ("checkpoint", "randomk"),
    ("checkpoint", "sketch"), ("checkpoint", "sgp"), ("h5", "powersgd"),
])
def test_resume_in_a_new_process_matches_the_uninterrupted_run(tmp_path, save_format, compression):
    flags = [f"--format={save_format}", f"--compression={compression}", f"--work_dir={tmp_path}"]
    full = run_ranks("checkpoint.py", "--phase=full", *flags, np=2)
    resumed = run_ranks("checkpoint.py", "--phase=resume", *flags, np=2)
    for before, after in zip(full, resumed):
        assert after["iterations"] == before["iterations"] == 24
        assert after["num_optimizer_variables"] == before["num_optimizer_variables"]
        assert after["model"] == before["model"]  # bit-identical parameters
        assert after["optimizer"] == before["optimizer"]  # and residuals, momenta, server residuals
    assert full[0]["residual_norm"] > 0


def test_exported_savedmodel_predicts_without_horovod_or_hvd_compress(tmp_path):
    export = tmp_path / "export"
    run_ranks("checkpoint.py", "--phase=full", f"--work_dir={tmp_path}", f"--export_dir={export}", np=2)
    code = f"""
import sys, numpy as np, tensorflow as tf
loaded = tf.saved_model.load({str(export)!r})
serve = loaded.signatures["serving_default"]
logits = list(serve(tf.constant(np.load({str(export / 'inputs.npy')!r}))).values())[0].numpy()
np.testing.assert_allclose(logits, np.load({str(export / 'logits.npy')!r}), rtol=1e-5, atol=1e-5)
assert not any(m.split('.')[0] in ('horovod', 'hvd_compress') for m in sys.modules), 'imported'
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
