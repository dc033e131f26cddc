"""hierarchical=True on hosts of several ranks (tests/hvdrun.run_hosts: Horovod's own Gloo launch with a host name
per host, on this machine): every compressor's hierarchical rule against its NumPy reference on every rank, at
layouts 1x2, 2x1, 2x2 and 2x3; per-rank checkpoints across layouts; model.fit; and the layouts it refuses, before
any collective.

One launch serves several tests (LAUNCHES): a launch's start-up, every rank importing TensorFlow, costs more than
what its ranks then run."""
import pytest

from hvdrun import KERASES, run_hosts

#: Layout ("HxL": H hosts of L ranks) -> ranks per host.
LAYOUTS = {"1x2": (2,), "2x1": (1, 1), "2x2": (2, 2), "2x3": (3, 3)}
#: Every rule case of tests/workers/hierarchical.py.
RULES = ["onebit two-way", "onebit one-way blocks", "topk", "randomk", "powersgd", "quantize 4 bits",
         "quantize 8 bits rounded without feedback", "sketch", "fetchsgd", "1-bit Adam two-way",
         "1-bit AdamW one-way blocks", "none", "fp16"]
#: The rules the default run checks at each layout: each rule meets a layout of several hosts (2x2 or 2x1) and a
#: host of several ranks (2x2 or 1x2), and each layout every kind of hierarchical path (sharded with error
#: feedback, whole tensors to one rank, a sketch, 1-bit Adam, Horovod's own allreduce). --full: every rule everywhere.
CROSSING_SHARDS = ["onebit two-way", "topk", "powersgd", "quantize 4 bits", "sketch", "1-bit Adam two-way", "none"]
WHOLE_OR_LOCAL = ["onebit one-way blocks", "randomk", "powersgd", "quantize 8 bits rounded without feedback",
                  "fetchsgd", "1-bit AdamW one-way blocks", "fp16"]
ROTATED_RULES = {"2x2": CROSSING_SHARDS, "2x1": WHOLE_OR_LOCAL, "1x2": WHOLE_OR_LOCAL}
#: The launches under tf_keras, in order: (layout, what it runs (workers/hierarchical.py's --modes), its flags).
#: The checkpoints saved at 2x2 are resumed by the later ones; at 2x1 rank 0 is the slow host.
LAUNCHES = [("2x2", ["rules", "save", "fit"], []), ("2x2", ["resume"], []), ("1x2", ["rules", "resume"], []),
            ("2x1", ["rules", "resume"], ["--slow_rank=0"])]


def rules_at(layout, full_matrix):
    return RULES if full_matrix else ROTATED_RULES.get(layout, RULES)


def launch(layout, modes, *flags, full_matrix=False, env=None):
    """[{mode: result}] per rank of hierarchical.py at `layout`, running `modes` in turn."""
    return run_hosts("hierarchical.py", f"--modes={','.join(modes)}",
                     f"--cases={','.join(rules_at(layout, full_matrix))}", *flags, ranks_per_host=LAYOUTS[layout],
                     timeout=600, env=env)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, full_matrix):
    """{(layout, mode): per-rank results} of LAUNCHES, and the folder of their checkpoints."""
    work_dir = tmp_path_factory.mktemp("checkpoints")
    results = {}
    for layout, modes, flags in LAUNCHES:
        ranks = launch(layout, modes, f"--work_dir={work_dir}", *flags, full_matrix=full_matrix,
                       env=KERASES["tf_keras"])
        results.update({(layout, mode): [r[mode] for r in ranks] for mode in modes})
    return results, work_dir


@pytest.mark.parametrize("layout", ["1x2", "2x1", "2x2", pytest.param("2x3", marks=pytest.mark.full)])
def test_hierarchical_rules_match_the_numpy_reference_on_every_rank(layout, launched, full_matrix):
    """onebit (two-way; one-way in blocks), top-k, random-k, PowerSGD (whole tensors to one rank of a host), the
    quantizer (4 bits stochastic, 8 bits rounded without feedback), sketched SGD and FetchSGD (on each rank's shard),
    1-bit Adam and AdamW (bit for bit), none and fp16 (Horovod's hierarchical allreduce, in float32 or 16 bits
    across hosts): every rank equals the reference and all ranks end bit-identical; Horovod saw the layout.
    (Rotated over the layouts by ROTATED_RULES; --full: every case at every layout.)"""
    results, _ = launched
    if (layout, "rules") in results:
        results = results[layout, "rules"]
    else:
        results = [r["rules"] for r in launch(layout, ["rules"], full_matrix=full_matrix)]
    hosts, local = len(LAYOUTS[layout]), LAYOUTS[layout][0]
    assert [tuple(r["layout"]) for r in results] == [(l, local, h, hosts) for h in range(hosts) for l in range(local)]
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert sorted(results[0]["digests"]) == sorted(rules_at(layout, full_matrix))
    # On a single host nothing crosses a host link: rank 0 says so, once a plan; elsewhere nothing is said.
    assert (results[0]["single_host_warnings"] > 0) == (hosts == 1)
    assert all(r["single_host_warnings"] == 0 for r in results[1:])


def test_hosts_of_unequal_sizes_are_refused_with_the_fix():
    results = run_hosts("hierarchical.py", "--modes=refused", ranks_per_host=(2, 1), timeout=240)
    for r in results:
        assert "same number of ranks on every host" in r["refused"] and "hierarchical=False" in r["refused"], r


def test_without_dynamic_process_sets_the_error_says_how_to_start_horovod():
    results = run_hosts("hierarchical.py", "--modes=refused", ranks_per_host=(1, 1), timeout=240,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "0"})
    for r in results:
        assert "process_sets='dynamic'" in r["refused"] and "HOROVOD_DYNAMIC_PROCESS_SETS=1" in r["refused"], r


def test_a_checkpoint_at_2x2_resumes_exactly_there_and_afresh_at_1x2_and_2x1(launched):
    """Per-rank checkpoints of hierarchical onebit at 2x2: a resume at 2x2 continues bit for bit as the
    uninterrupted run; at 1x2 and 2x1 (the same ranks 0 and 1, another layout) the host's residual and
    server shards start afresh, rank 0 says so, and the ranks stay identical.

    And a host that finishes first waits at its exit for the others: a hierarchical step ends inside the host, and
    one rank's exit shuts Horovod down on every rank, failing what another host still has in flight. At 2x1 rank 0
    is 3 s slower after its last step; rank 1 must leave only after rank 0 is done."""
    results, work_dir = launched
    full, resumed = results["2x2", "save"], results["2x2", "resume"]
    assert [r["digest"] for r in resumed] == [r["digest"] for r in full]
    assert len({r["digest"] for r in full}) == 1 and not any("reset" in line for line in resumed[0]["logged"])
    for layout in ("1x2", "2x1"):
        other = results[layout, "resume"]
        assert len({r["digest"] for r in other}) == 1 and other[0]["moved"] > 0, layout
        assert any("reset its per-rank and sharded state" in line for line in other[0]["logged"]), other[0]["logged"]
    assert float((work_dir / "exit1").read_text()) >= results["2x1", "resume"][0]["finished"]


@pytest.mark.parametrize("keras", list(KERASES))
def test_model_fit_trains_hierarchically_under_mixed_precision_with_ranks_identical_after_every_batch(keras, launched):
    """As users run it, in either Keras: model.fit, mixed_float16 (compile's LossScaleOptimizer), AdamW with 1-bit Adam
    after a 5-step warm-up, hierarchical at 2x2, rank 0's weights broadcast first. (tf_keras: in LAUNCHES' first.)"""
    results, _ = launched
    if keras == "tf_keras":
        results = results["2x2", "fit"]
    else:
        results = [r["fit"] for r in launch("2x2", ["fit"], env=KERASES[keras])]
    for r in results:
        assert r["steps_checked"] == 30 and r["loss_scaled"].startswith("LossScaleOptimizer"), r
        assert r["losses"][-1] < r["losses"][0], r["losses"]
