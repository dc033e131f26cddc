"""Multi-rank behaviour under horovodrun (Gloo and MPI), each run with a hard timeout."""
import pytest

from hvdrun import run_ranks


@pytest.mark.parametrize("launcher, np", [("gloo", 2), ("mpi", 2), ("gloo", 4)])
def test_allgathered_sign_payloads_decode_to_the_numpy_mean(launcher, np):
    results = run_ranks("sign_allgather.py", np=np, launcher=launcher)
    assert [r["size"] for r in results] == [np] * np
    assert all(r["digests"] == results[0]["digests"] for r in results)  # every rank decodes the same


def test_a_hung_rank_fails_fast_with_its_output():
    with pytest.raises(pytest.fail.Exception, match="timed out after 20s"):
        run_ranks("hang.py", np=2, timeout=20)
