"""Each rank saves its own file: a checkpoint resumes every piece of state exactly; a model file
resumes the model and the replicated state, and per-rank state starts afresh (docs/state_and_checkpoints.md).
The default run: every kind of state in each Keras, one launch per Keras (LEFT_OUT); --full runs every case."""
import os
import subprocess
import sys

import pytest

from hvdrun import KERASES, run_ranks


# Every method and every format, written by rank 0: test_conventions.py.
CHECKPOINTS = {"tf_keras": ["checkpoint/onebit", "weights/onebit", "checkpoint/randomk", "checkpoint/sketch",
                            "checkpoint/sgp", "weights/powersgd", "checkpoint/onebit_adamw"],
               "keras3": ["checkpoint/onebit", "checkpoint/sgp", "checkpoint/powersgd", "checkpoint/onebit_adamw",
                          "checkpoint/topk_adamw"]}
MODEL_FILES = {"tf_keras": ["h5/powersgd", "savedmodel/sgp", "h5/onebit_adamw", "h5/topk_adamw"],
               "keras3": ["keras/powersgd", "keras/sgp", "keras/onebit_adamw"]}
#: SGP over MPI point to point (an MPI launch, Keras 3): the mass in flight when saved is in the files.
CHECKPOINTS["keras3_mpi"], MODEL_FILES["keras3_mpi"] = ["checkpoint/sgp_mpi"], ["keras/sgp_mpi"]
#: --full: a launch per Keras and launcher, every case of the lists above.
LAUNCHES = {"tf_keras": ("tf_keras", "gloo"), "keras3": ("keras3", "gloo"), "keras3_mpi": ("keras3", "mpi")}
CASES = [(launch, case) for launch in LAUNCHES for case in CHECKPOINTS[launch] + MODEL_FILES[launch]]
#: Left out of the default run, each a second case of a kind of state already resumed in its Keras and file
#: family (weights/powersgd holds weights; sketch's per-rank residual is randomk's kind; SGP's PushSum state over
#: alltoall is its MPI twin's; h5/topk_adamw holds AdamW's slots): each Keras still resumes every kind of state
#: (server shards, per-rank residual, replicated Q, PushSum, Keras's own slots) from a checkpoint and writes
#: each of its formats. Keras 3's gloo cases run in its MPI launch (saving and restoring do not depend on the
#: controller): one launch per Keras.
LEFT_OUT = {("tf_keras", "weights/onebit"), ("tf_keras", "checkpoint/sketch"), ("tf_keras", "h5/onebit_adamw"),
            ("keras3", "checkpoint/sgp"), ("keras3", "keras/sgp")}
DEFAULT_LAUNCHES = {"tf_keras": ["tf_keras"], "keras3_mpi": ["keras3", "keras3_mpi"]}


def params(kind):
    """The (launch, case) pairs of `kind` (CHECKPOINTS or MODEL_FILES); those LEFT_OUT of the default run: --full."""
    return [pytest.param(*c, marks=[pytest.mark.full] if c in LEFT_OUT else []) for c in CASES if c[1] in kind[c[0]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, full_matrix):
    """Per case list (LAUNCHES' keys): each rank's results of the uninterrupted run and of the run resumed
    halfway, per case (2 ranks; every case of a launch in one launch per phase). tf_keras's first case's model
    is exported."""
    everything = {}
    grouped = {launch: [launch] for launch in LAUNCHES} if full_matrix else DEFAULT_LAUNCHES
    for launch, lists in grouped.items():
        keras, launcher = LAUNCHES[launch]
        work = tmp_path_factory.mktemp(f"checkpoints-{launch}")
        cases = [case for part in lists for case in CHECKPOINTS[part] + MODEL_FILES[part]
                 if full_matrix or (part, case) not in LEFT_OUT]
        flags = [f"--cases={','.join(cases)}", f"--work_dir={work}"]
        if launch == "tf_keras":
            flags.append(f"--export_dir={work / 'export'}")
            everything["export"] = work / "export"
        phases = [run_ranks("checkpoint.py", f"--phase={phase}", *flags, np=2, launcher=launcher, timeout=600,
                            env=KERASES[keras]) for phase in ("full", "resume")]
        everything.update({part: phases for part in lists})
    return everything


def phases(runs, keras, case):
    return ([rank[case] for rank in phase] for phase in runs[keras])


@pytest.mark.parametrize("keras, case", params(CHECKPOINTS))
def test_resume_from_a_checkpoint_matches_the_uninterrupted_run(runs, keras, case):
    full, resumed = phases(runs, keras, case)
    for before, after in zip(full, resumed):
        assert after["iterations"] == before["iterations"] == 12  # 2 x workers/checkpoint.STEPS
        assert after["num_optimizer_variables"] == before["num_optimizer_variables"]
        assert after["at_restore"] == before["at_save"]
        assert after["at_end"] == before["at_end"]  # bit-identical parameters and every piece of state
        assert before["at_save"]["rank_state"] != before["at_save"]["fresh_rank_state"]
    assert full[0]["at_save"]["rank_state"] != full[1]["at_save"]["rank_state"]
    assert full[0]["residual_norm"] > 0
    assert resumed[0]["transport"] == full[0]["transport"]
    if "/sgp" in case:  # the mass the save took out of MPI and the restore brought back is mixed in, not lost
        for run in (full, resumed):
            assert sum(rank["mass"] for rank in run) == pytest.approx(len(run), abs=1e-6)


@pytest.mark.parametrize("keras, case", params(MODEL_FILES))
def test_a_model_file_resumes_the_model_and_replicated_state(runs, keras, case):
    full, resumed = phases(runs, keras, case)
    for before, after in zip(full, resumed):
        assert after["iterations"] == before["iterations"] == 12  # 2 x workers/checkpoint.STEPS
        assert after["at_restore"]["model"] == before["at_save"]["model"]
        assert after["at_restore"]["replicated"] == before["at_save"]["replicated"]
        assert after["at_restore"]["rank_state"] == after["at_restore"]["fresh_rank_state"]
        assert (after["adamw"], after["warmup_steps"], after["transport"]) == (
            before["adamw"], before["warmup_steps"], before["transport"])  # as saved
    assert resumed[0]["at_end"]["model"] == resumed[1]["at_end"]["model"] or "/sgp" in case


def test_exported_savedmodel_predicts_without_horovod_or_hvd_compress(runs, tmp_path):
    export = runs["export"]
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


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_model_fit_resumed_from_rank0s_model_file_continues_the_run(keras, tmp_path):
    """A user's resume (workers/resume_fit.py): 1-bit Adam, Adam with a frozen variance under top-k and quantize, and
    dist-EF-SGD, rank 0's .keras file of epoch 3 loaded on every rank; epoch 4 ends with a loss within 15% of the
    uninterrupted run's, the ranks identical after every batch. Before the frozen-variance steps were bounded, 1-bit
    Adam's resumed epoch ended at 3.2 against 0.31 (and diverged without a resume under a 20-step warm-up)."""
    flags = [f"--work_dir={tmp_path}"]
    full, resumed = (run_ranks("resume_fit.py", f"--phase={phase}", *flags, np=2, timeout=600, env=KERASES[keras])
                     for phase in ("full", "resume"))
    mean_loss = lambda run, case, epoch: sum(rank["results"][case]["loss"][epoch] for rank in run) / len(run)  # noqa
    for case in full[0]["results"]:
        first, uninterrupted, after = mean_loss(full, case, 0), mean_loss(full, case, -1), mean_loss(resumed, case, 0)
        assert uninterrupted < 0.6 * first, (case, first, uninterrupted)  # the uninterrupted run trains
        assert abs(after - uninterrupted) <= 0.15 * uninterrupted, (case, uninterrupted, after)
        assert resumed[0]["results"][case]["optimizer"] == full[0]["results"][case]["optimizer"]
        assert all(rank["results"][case]["checked"] > 0 for rank in full + resumed)
