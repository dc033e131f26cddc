"""Each rank saves its own file: a checkpoint resumes every piece of state exactly; a model file
resumes the model and the replicated state, and per-rank state starts afresh (docs/design.md)."""
import os
import subprocess
import sys

import pytest

from hvdrun import run_ranks


def save_and_resume(tmp_path, save_format, compression):
    """Each rank's results of the uninterrupted run and of the run resumed halfway (2 ranks)."""
    flags = [f"--format={save_format}", f"--compression={compression}", f"--work_dir={tmp_path}"]
    return (run_ranks("checkpoint.py", "--phase=full", *flags, np=2),
            run_ranks("checkpoint.py", "--phase=resume", *flags, np=2))


@pytest.mark.parametrize("save_format, compression", [
    ("checkpoint", "onebit"), ("weights", "onebit"), ("checkpoint", "randomk"), ("checkpoint", "sketch"),
    ("checkpoint", "sgp"), ("weights", "powersgd"),
])
def test_resume_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path, save_format, compression):
    full, resumed = save_and_resume(tmp_path, save_format, compression)
    for before, after in zip(full, resumed):
        assert after["iterations"] == before["iterations"] == 24
        assert after["num_optimizer_variables"] == before["num_optimizer_variables"]
        assert after["at_restore"] == before["at_save"]
        assert after["at_end"] == before["at_end"]  # bit-identical parameters and every piece of state
        assert before["at_save"]["rank_state"] != before["at_save"]["fresh_rank_state"]
    assert full[0]["at_save"]["rank_state"] != full[1]["at_save"]["rank_state"]
    assert full[0]["residual_norm"] > 0


@pytest.mark.parametrize("save_format, compression", [("h5", "powersgd"), ("savedmodel", "sgp")])
# (every method and both model formats, written by rank 0: tests/test_conventions.py)
def test_a_model_file_resumes_the_model_and_replicated_state(tmp_path, save_format, compression):
    full, resumed = save_and_resume(tmp_path, save_format, compression)
    for before, after in zip(full, resumed):
        assert after["iterations"] == before["iterations"] == 24
        assert after["at_restore"]["model"] == before["at_save"]["model"]
        assert after["at_restore"]["replicated"] == before["at_save"]["replicated"]
        assert after["at_restore"]["rank_state"] == after["at_restore"]["fresh_rank_state"]
    assert resumed[0]["at_end"]["model"] == resumed[1]["at_end"]["model"] or compression == "sgp"


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
