"""hierarchical=True on hosts of several ranks (tests/hvdrun.run_hosts: Horovod's own Gloo launch with a host name
per host, on this machine): every compressor's hierarchical rule against its NumPy reference on every rank, at
layouts 1x2, 2x1, 2x2 and 2x3, and the layouts it refuses, before any collective."""
import pytest

from hvdrun import KERASES, run_hosts


@pytest.mark.parametrize("ranks_per_host", [(2,), (1, 1), (2, 2), pytest.param((3, 3), marks=pytest.mark.full)],
                         ids=["1x2", "2x1", "2x2", "2x3"])
def test_hierarchical_rules_match_the_numpy_reference_on_every_rank(ranks_per_host):
    """onebit (two-way; one-way in blocks), top-k, random-k, PowerSGD (whole tensors to one rank of a host), the
    quantizer (4 bits stochastic, 8 bits rounded without feedback), sketched SGD and FetchSGD (on each rank's shard),
    1-bit Adam and AdamW (bit for bit), none and fp16 (Horovod's hierarchical allreduce, in float32 or 16 bits
    across hosts): every rank equals the reference and all ranks end bit-identical; Horovod saw the layout."""
    results = run_hosts("hierarchical.py", ranks_per_host=ranks_per_host, timeout=400)
    hosts, local = len(ranks_per_host), ranks_per_host[0]
    assert [tuple(r["layout"]) for r in results] == [(l, local, h, hosts) for h in range(hosts) for l in range(local)]
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert len(results[0]["digests"]) == 13


def test_hosts_of_unequal_sizes_are_refused_with_the_fix():
    results = run_hosts("hierarchical.py", "--mode=refused", ranks_per_host=(3, 2), timeout=240)
    for r in results:
        assert "same number of ranks on every host" in r["refused"] and "hierarchical=False" in r["refused"], r


def test_without_dynamic_process_sets_the_error_says_how_to_start_horovod():
    results = run_hosts("hierarchical.py", "--mode=refused", ranks_per_host=(1, 1), timeout=240,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "0"})
    for r in results:
        assert "process_sets='dynamic'" in r["refused"] and "HOROVOD_DYNAMIC_PROCESS_SETS=1" in r["refused"], r


def test_a_checkpoint_at_2x2_resumes_exactly_there_and_afresh_at_1x2_and_2x1(tmp_path):
    """Per-rank checkpoints of hierarchical onebit at 2x2: a resume at 2x2 continues bit for bit as the
    uninterrupted run; at 1x2 and 2x1 (the same ranks 0 and 1, another layout) the host's residual and
    server shards start afresh, rank 0 says so, and the ranks stay identical.

    And a host that finishes first waits at its exit for the others: a hierarchical step ends inside the host, and
    one rank's exit shuts Horovod down on every rank, failing what another host still has in flight. At 2x1 rank 0
    is 3 s slower after its last step; rank 1 must leave only after rank 0 is done."""
    full = run_hosts("hierarchical.py", "--mode=save", "--steps=3", f"--work_dir={tmp_path}", ranks_per_host=(2, 2))
    resumed = run_hosts("hierarchical.py", "--mode=resume", "--steps=3", f"--work_dir={tmp_path}",
                        ranks_per_host=(2, 2))
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert len({r["digest"] for r in full}) == 1 and not any("reset" in line for line in resumed[0]["logged"])
    for layout in ((2,), (1, 1)):
        slow = ["--slow_rank=0"] if layout == (1, 1) else []
        other = run_hosts("hierarchical.py", "--mode=resume", "--steps=3", f"--work_dir={tmp_path}", *slow,
                          ranks_per_host=layout)
        assert len({r["digest"] for r in other}) == 1 and other[0]["moved"] > 0, layout
        assert any("reset its per-rank and sharded state" in line for line in other[0]["logged"]), other[0]["logged"]
    assert float((tmp_path / "exit1").read_text()) >= other[0]["finished"]


@pytest.mark.parametrize("keras", list(KERASES))
def test_model_fit_trains_hierarchically_under_mixed_precision_with_ranks_identical_after_every_batch(keras):
    """As users run it, in either Keras: model.fit, mixed_float16 (compile's LossScaleOptimizer), AdamW with 1-bit Adam
    after a 5-step warm-up, hierarchical at 2x2, rank 0's weights broadcast first."""
    results = run_hosts("hierarchical.py", "--mode=fit", ranks_per_host=(2, 2), env=KERASES[keras])
    for r in results:
        assert r["steps_checked"] == 30 and r["loss_scaled"].startswith("LossScaleOptimizer"), r
        assert r["losses"][-1] < r["losses"][0], r["losses"]
