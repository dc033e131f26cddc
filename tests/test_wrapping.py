"""Wrapping keeps the user's optimizer instance whole, and hvd_compress refuses what would hang or
train wrong in silence: each case as a user meets it, under horovodrun (workers/wrapping.py)."""
import pytest

from hvdrun import KERASES, run_ranks


@pytest.fixture(scope="module", params=list(KERASES))
def ranks(request, tmp_path_factory):
    keras = request.param
    return keras, run_ranks("wrapping.py", f"--work_dir={tmp_path_factory.mktemp(keras)}", np=2, timeout=300,
                            env=KERASES[keras])


def same_on_every_rank(ranks, case):
    facts = [rank[case] for rank in ranks]
    assert all(f == facts[0] for f in facts), (case, facts)
    return facts[0]


def test_wrapping_keeps_settings_outside_the_config(ranks):
    _, ranks = ranks
    exclusions = same_on_every_rank(ranks, "exclusions")
    assert exclusions == {"same_object": True, "moved": {"kernel": True, "bias": False}}


def test_wrapping_keeps_an_optimizer_that_already_trained(ranks):
    _, ranks = ranks
    trained = same_on_every_rank(ranks, "trained")  # digests after model.compile: the ranks agree
    assert {k: trained[k] for k in ("same_object", "iterations", "slots_kept", "count_kept")} == {
        "same_object": True, "iterations": 5, "slots_kept": True, "count_kept": True}
    assert "model.compile(optimizer=...) again" in trained["stale_step_refused"]


def test_model_files_beyond_the_matrix(ranks):
    """hc.load_model(compression=) replaces the saved compression; PushSum files; rank 0 alone loads."""
    _, ranks = ranks
    assert ranks[0]["files"]["alone_loss"] > 0
    facts = [{k: v for k, v in rank["files"].items() if k != "alone_loss"} for rank in ranks]
    assert all(f == facts[0] for f in facts), facts
    assert "FP16Compressor" in facts[0]["overridden"]
    assert facts[0]["pushsum_keras"] == facts[0]["pushsum_hc"] == ["PushSumOptimizer", "exponential"]


def test_wrapping_keeps_a_subclass_argument_callables_and_unregistered_schedules(ranks):
    _, ranks = ranks
    assert same_on_every_rank(ranks, "subclass") == {"moved": False}  # ScaledSGD(scale=0): nothing moves
    same_on_every_rank(ranks, "callables")  # trained, and the ranks are identical


def test_distributed_gradient_tape_inside_tf_function(ranks):
    _, ranks = ranks
    same_on_every_rank(ranks, "tape")


def test_lazily_built_models_with_the_broadcast_callback(ranks):
    _, ranks = ranks
    lazy = same_on_every_rank(ranks, "lazy")  # every batch's weights: the same on every rank
    assert all(len(digests) == 4 for digests in lazy.values())


def test_unequal_steps_per_rank_are_refused_before_the_first_step(ranks):
    _, ranks = ranks
    refused = same_on_every_rank(ranks, "uneven")["refused"]
    assert refused and "[5, 4]" in refused and "steps_per_epoch" in refused


def test_load_weights_says_what_it_restored(ranks):
    keras, ranks = ranks
    for rank in ranks:
        assert rank["load_weights"]["same_weights"]
        assert not any("optimizer's replicated state" in line for line in rank["load_weights"]["lines"])
    if keras == "keras3":  # rank 0 says that Keras skipped the optimizer, which was not built
        assert any("restored the model only" in line for line in ranks[0]["load_weights"]["lines"])


def test_the_guard_refuses_an_undistributed_optimizer_at_two_ranks(ranks):
    _, ranks = ranks
    guard = same_on_every_rank(ranks, "guard")
    assert "plain SGD on 2 ranks" in guard["refused"] and "hvd_compress.DistributedOptimizer" in guard["refused"]
    assert guard["opted_out_refused"] is None


def test_mixed_precision_trains_without_any_callback(ranks):
    _, ranks = ranks
    assert same_on_every_rank(ranks, "mixed_without_callbacks")["loss_scaled"]


def test_the_guard_lets_one_rank_train(tmp_path):
    (rank,) = run_ranks("wrapping.py", f"--work_dir={tmp_path}", "--cases=guard", np=1, timeout=180)
    assert rank["guard"] == {"refused": None, "opted_out_refused": None, "size": 1}


def test_the_readmes_custom_loop_runs_as_written():
    """The README's custom-loop code block, with the broadcasts it asks for, at 2 ranks with different initial
    weights, under Keras 3 (where Horovod's own broadcast fails; tf_keras's loop: workers/wrapping.py's tape case):
    the ranks end identical and the loss falls."""
    ranks = run_ranks("readme_loop.py", np=2, timeout=300, env=KERASES["keras3"])
    assert ranks[0]["digest"] == ranks[1]["digest"]
    for rank in ranks:
        assert sum(rank["losses"][-5:]) < 0.8 * sum(rank["losses"][:5]), rank["losses"]
