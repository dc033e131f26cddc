"""Multi-rank behaviour under horovodrun (Gloo and MPI), each run with a hard timeout."""
import pytest

from hvdrun import run_ranks


# Gloo at 2 ranks repeats what Gloo at 4 and MPI at 2 cover: --full only.
@pytest.mark.parametrize("launcher, np", [pytest.param("gloo", 2, marks=pytest.mark.full), ("mpi", 2), ("gloo", 4)])
def test_allgathered_sign_payloads_decode_to_the_numpy_mean(launcher, np):
    results = run_ranks("sign_allgather.py", np=np, launcher=launcher)
    assert [r["size"] for r in results] == [np] * np
    assert all(r["digests"] == results[0]["digests"] for r in results)  # every rank decodes the same


# At 3 ranks every pair of ranks exchanges as 2 ranks do: 2 runs under --full only.
@pytest.mark.parametrize("np", [pytest.param(2, marks=pytest.mark.full), 3])
def test_gloo_alltoall_and_allgather_of_uneven_sizes_match_numpy(np):
    """The Gloo collectives our Horovod patch reorders (receives before sends), odd world included."""
    results = run_ranks("uneven_collectives.py", np=np)
    assert [(r["size"], r["checked"]) for r in results] == [(np, [3, 300_001])] * np


def test_a_hung_rank_fails_fast_with_its_output():
    with pytest.raises(pytest.fail.Exception, match="timed out after 20s"):
        run_ranks("hang.py", np=2, timeout=20)


def test_ranks_that_drift_apart_are_caught_at_the_batch_they_differ():
    """workers/_worker.IdenticalRanks, which the training tests rely on: rank 1 alone nudges a
    weight after batch 2 of epoch 1; both ranks fail naming that batch (epoch 0 passed)."""
    results = run_ranks("diverge.py", np=2)
    for result in results:
        assert result["caught"] == "onebit: ranks differ after batch 2 of epoch 1", result
        assert result["checked"] == 4  # epoch 0's 4 batches
