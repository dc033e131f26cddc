"""Data of unknown length that runs out at different steps on different ranks (hvd_compress/uneven.py), run as a user
runs it (workers/uneven_data.py): generator datasets of 10 and 8 batches (and 9 on a third rank), model.fit with
hvd_compress's callbacks and custom loops in hc.stop_together(). Before, the short rank ended its epoch and the
long rank waited forever in its next step's exchange (or paired it with the short rank's next epoch)."""
import math

import pytest

from hvdrun import KERASES, run_ranks

#: the worker's cases run under each Keras (tf_keras refuses steps_per_execution > 1 on data of unknown length): none,
#: onebit and top-k under model.fit and in custom loops, few enough to keep the default suite in its time budget
CASES = {
    "keras3": ["fit_none", "fit_onebit_steps_per_execution", "fit_topk_loss_scale", "loop_onebit", "loop_topk_tape"],
    "tf_keras": ["fit_topk_loss_scale", "loop_onebit"],
}
SHORTEST = 8  # workers/uneven_data.py's BATCHES: 10, 8, 9 on ranks 0, 1, 2


def check_every_epoch_ended_together(ranks):
    for case in ranks[0]["results"]:
        runs = [rank["results"][case] for rank in ranks]
        print(case, "steps per epoch", [r["steps"] for r in runs],
              "seconds from the last batch to the epoch's end", [[round(s, 2) for s in r["after_last_batch"]]
                                                                 for r in runs])
        assert all(r["steps"] == [SHORTEST] * len(r["steps"]) for r in runs), case
        assert all(s < 60 for r in runs for s in r["after_last_batch"]), case
        assert len({r["digest"] for r in runs}) == 1, case  # identical ranks after the fit or the loop
        assert all(r["checked"] is None or r["checked"] == SHORTEST * len(r["steps"]) for r in runs), case
        losses = runs[0]["loss"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (case, losses)


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_data_of_unknown_length_ends_every_epoch_on_every_rank_at_the_shortest(keras):
    """none, onebit (with steps_per_execution 3) and top-k (in a LossScaleOptimizer) under model.fit, and custom
    loops (onebit in a wrapped optimizer, top-k through a DistributedGradientTape): each epoch of 2 ends on both
    ranks after 8 steps, within 60 s of the last batch, the ranks bit-identical after every batch and the loss
    going down. (workers/uneven_data.py has more cases: fit_onebit, fit_topk, loop_none, loop_topk.)"""
    check_every_epoch_ended_together(
        run_ranks("uneven_data.py", f"--cases={','.join(CASES[keras])}", np=2, timeout=420, env=KERASES[keras]))


def test_data_of_unknown_length_at_three_ranks():
    """Three ranks of 10, 8 and 9 batches: model.fit ends each epoch together after 8."""
    check_every_epoch_ended_together(
        run_ranks("uneven_data.py", "--cases=fit_topk", np=3, timeout=300, env=KERASES["keras3"]))
