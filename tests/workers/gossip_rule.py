"""hc.PushSumOptimizer's step against the NumPy reference of PushSum with messages delayed by tau steps
(overlap=False: 0; overlap=True: 1), on every rank, over both transports.

Each case trains w and b (rule_inputs: every rank its own gradients) with SGD without momentum, or AdamW on
rule_inputs' schedule, for --steps graph-mode steps. Over alltoall each world size of --world_sizes runs on a
process set of ranks 0..n-1; over MPI (launched with MPI only) the whole world runs, and must give the alltoall
run's bits. Every case runs at the launch's world size; below it, CASES_BELOW_LAUNCH (--every_case_at_every_size:
every case). After the steps every rank holds the reference's z_i; the weights with the mass in flight (what
`flush` leaves in in_flight) sum to n. Reports {"n/transport/case": digest} and the sums. Rank 0 leaves 2 s after
the others, as after saving a model: the mailboxes, closed at exit, must hold back Horovod's shutdown on the
others (it finalises MPI on every rank)."""
import hashlib
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import hvd_compress as hc
import np_reference as ref
from hvd_compress.gossip import in_peers, out_peers
from rule_inputs import adam, adam_rate, grads_of, train
from _worker import init_world_sizes, launch_size, report

flags.DEFINE_integer("steps", 6, "Steps of each case.")
flags.DEFINE_list("world_sizes", None, "World sizes of the alltoall runs (default: the number of ranks).")
flags.DEFINE_bool("every_case_at_every_size", False, "Every case at each world size, not CASES_BELOW_LAUNCH.")
flags.DEFINE_bool("refused", False, "Only report the error of PushSumOptimizer(transport='mpi') (a Gloo launch).")
FLAGS = flags.FLAGS
LR = 0.1
WEIGHT_DECAY = 0.05
#: (graph, overlap, average_every, inner optimizer)
CASES = [("exponential", False, None, "sgd"), ("exponential", True, None, "sgd"), ("exponential2", True, None, "sgd"),
         ("ring", True, 4, "sgd"), ("exponential", True, None, "adamw")]
#: The cases at world sizes below the launch's: every graph, with and without overlap and average_every, meets each
#: size (the cases left out, exponential with overlap under SGD and AdamW, add no such pair; they run at the launch's
#: size).
CASES_BELOW_LAUNCH = [CASES[0], *CASES[2:4]]


def flat(rank, t):
    return np.concatenate([g.reshape(-1) for g in grads_of(rank, t)])


def inner(optimizer):
    """The wrapped optimizer: SGD at LR, or AdamW (rule_inputs.adam: a tenth of the schedule)."""
    return tf.keras.optimizers.SGD(LR) if optimizer == "sgd" else adam(weight_decay=WEIGHT_DECAY)


def run(graph, overlap, average_every, optimizer, process_set, transport):
    """This rank's z (w and b, flat) after the steps, and the weight plus the mass in flight."""
    w, b, opt, _ = train(inner(optimizer), FLAGS.steps, process_set.rank(), wrap=hc.PushSumOptimizer,
                         graph=graph, overlap=overlap, average_every=average_every, process_set=process_set,
                         transport=transport)
    opt.pushsum.flush()
    mass = opt.pushsum.weight + (opt.pushsum.in_flight[-1] if overlap else 0.0)
    mass = float(hvd.allreduce(mass, op=hvd.Sum, process_set=process_set, name=f"mass.{transport}"))
    return np.concatenate([w, b]), mass


def reference(graph, overlap, average_every, optimizer, n, rank):
    d = flat(0, 0).size
    pushsum = ref.PushSum([np.zeros(d, np.float32)] * n, lambda i, t: out_peers(graph, i, n, t),
                          lambda i, t: in_peers(graph, i, n, t), tau=int(overlap))
    # AdamW: each rank's Keras Adam with decay on its own gradients (OneBitAdam of one worker, never compressing)
    adams = [ref.OneBitAdam(d, 1, FLAGS.steps, weight_decay=WEIGHT_DECAY) for _ in range(n)]

    def update(r, t):
        """Rank r's inner step u_r from its z_r."""
        if optimizer == "sgd":
            return -np.float32(LR) * flat(r, t)
        stepped = pushsum.z[r].copy()
        adams[r].step(stepped, [flat(r, t)], np.float32(adam_rate(t)))
        return stepped - pushsum.z[r]

    for t in range(FLAGS.steps):
        pushsum.step([update(r, t) for r in range(n)], t)
        if average_every and (t + 1) % average_every == 0:  # the exact average, mass in flight included
            x = np.mean([np.append(z * w, w) + p for z, w, p in zip(pushsum.z, pushsum.w, pushsum.pending)], axis=0)
            pushsum.z, pushsum.w = [x[:-1] / x[-1]] * n, [x[-1]] * n
            pushsum.pending = [np.zeros_like(p) for p in pushsum.pending]
    return pushsum.z[rank], pushsum.mass()


def check(case, process_set, transport, digests, masses):
    n = process_set.size()
    z, mass = run(*case, process_set, transport)
    want, want_mass = reference(*case, n, process_set.rank())
    name = f"{n}/{transport}/{'+'.join(map(str, case))}"
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(z).max() > 0.01, name
    assert abs(mass - n) < 1e-4 and abs(want_mass - n) < 1e-4, (name, mass, want_mass)
    digests[name], masses[name] = hashlib.sha256(z.tobytes()).hexdigest(), mass


def refused():
    try:
        hc.PushSumOptimizer(tf.keras.optimizers.SGD(LR), transport="mpi")
    except RuntimeError as e:
        return str(e)
    return None


def main(_):
    hc.require_legacy_keras()
    if FLAGS.refused:
        hvd.init()
        return report(hvd, refused=refused())
    process_sets = init_world_sizes([int(n) for n in FLAGS.world_sizes or [launch_size()]])
    digests, masses = {}, {}
    for case in CASES:
        for n, process_set in process_sets.items():
            if case in CASES_BELOW_LAUNCH or n == launch_size() or FLAGS.every_case_at_every_size:
                check(case, process_set, "alltoall", digests, masses)
        if hvd.mpi_enabled():
            if hvd.size() not in process_sets:
                check(case, hvd.global_process_set, "alltoall", digests, masses)
            check(case, hvd.global_process_set, "mpi", digests, masses)
            name = "+".join(map(str, case))
            assert digests[f"{hvd.size()}/mpi/{name}"] == digests[f"{hvd.size()}/alltoall/{name}"], name
    report(hvd, digests=digests, masses=masses)
    if hvd.rank() == 0:  # leaves last, as after saving the model: the others' exit must not pull MPI from under it
        time.sleep(2)


if __name__ == "__main__":
    app.run(main)
