"""Wall-clock time to a test accuracy on a real shaped link: N ranks, each a host in its own network
namespace, or hosts of several ranks (--hosts=2x2).

    sudo .venv/bin/python benchmarks/time_to_accuracy.py           # the transformer: 1gbit,10gbit x 2 ranks
    sudo .venv/bin/python benchmarks/time_to_accuracy.py --task=digits --ranks=2,4   # the wide MLP on digits, SGD
    sudo .venv/bin/python benchmarks/time_to_accuracy.py --task=digits --hosts=2x2 --rates=1gbit
    sudo .venv/bin/python benchmarks/time_to_accuracy.py --task=text --methods=horovod_fp32,none,onebit_oneway_b256

Needs root (it exits with status 2 and says why otherwise). The network and
the launching are wire.py's: for every rate and host layout (--ranks=N: N hosts
of one rank; --hosts: wire.py's layouts), netns.Network(layout, rate) gives each
host its own namespace and a veth shaped to the rate in both directions, and launch.run_in_namespaces starts the ranks through
Horovod's RendezvousServer with a hard timeout per job (--timeout). The
methods are wire.make_optimizer's, by hc.methods' names (horovod_fp32 and
horovod_fp16 are Horovod's own DistributedOptimizer; none (the same fp32
allreduce in hvd_compress's wrapper, whose SGD update runs in fused kernels, as
in every hc method: it separates that from what compression buys), fp16,
onebit (two-way), topk (1%) and powersgd (rank 4) hvd_compress's; any other of
wire.METHODS, quantize8 for one, with --methods; no_exchange, where each rank trains alone and sends
nothing, gives the floor's step). Flags this script shares with wire.py (--rates, --ranks,
--hosts, --methods, --batch_size, --slow_start_after_idle, --launcher, --timeout, --out) are
wire.py's own, with this script's defaults; its --steps, --warmup, --idle_s
and --models do not apply here.

Three tasks (--task). `transformer` (the default) is examples/keras_transformer.py's causal
transformer on Python's documentation, in float32, with AdamW on a warm-up into a cosine decay and
clipping, for --epochs 3; every compressed method sends at full precision for its first 10%
of steps, as long as the learning rate's warm-up (--compression_warmup; onebit is 1-bit Adam
there). Its test set is 65,000 held-out characters, each one sample. It has 0.43M parameters
(1.7 MB of float32 gradient), so its step is compute-bound on this machine's CPU cores at both
rates: it shows what compression costs and keeps on today's workload, not what it saves on a slow
link.

`text` is today's optimizer on a model with a large exchange: the next character of the same text from
the TEXT_CONTEXT (24) characters before it, each embedded in 32 numbers, then a wide ReLU MLP (--layers' hidden
widths: 768 -> 4096 -> 4096 -> 1024 -> the vocabulary, 24.2M parameters, 97 MB of float32 gradient), under
the transformer's AdamW (peak 1e-3, warm-up into a cosine decay over the run, clipping) for 1 epoch; a window
starts every 24 characters, so each character of the training text is a target once. Its step computes for
about 0.6 s on one of this machine's cores (0.37 s forward and backward, the rest AdamW's update of 24M
weights; about 1.1 s with two ranks sharing the cores) and exchanges 97 MB at fp32, 0.8 s at 1 Gbit/s; unlike digits,
its test set is 5,000 held-out characters (the last of the text), each one sample, so one sample moves an
evaluation by 0.0002 (0.02 point). Compressed methods send at full precision for their first 10% of steps (as long as the learning rate's
warm-up: 1-bit Adam's variance is frozen after it).

`digits` is the bundled digits (examples/digits.py: scikit-learn's 8x8
images, nothing to download, a fixed stratified 80/20 split, rank r trains on
its own shard in a seeded order) with a wide ReLU MLP, 64 -> 4096 -> 4096 ->
1024 -> 10: 21.3M parameters, 85 MB of float32 gradient. Digits needs nothing
that wide (examples/digits.py's 20k-parameter CNN reaches 0.98 in
benchmarks/convergence.py), which is the point: the compute is small, 4 GFLOP
a step of 32 images (0.12 s for a batch of 64 on one idle core here), while
Horovod's fp32 ring allreduce sends 2 (N-1)/N x 85 MB per rank and step:
0.7 s on 2 ranks and 1.1 s on 4 at 1 Gbit/s. So at 1 Gbit/s the exchange
dominates the step, as it does for a large model on a slow network, and a
method's bytes per step show up in its time to accuracy; at 10 Gbit/s (70 to
110 ms of transfer) compute, the allreduce's own summing and the methods'
compression cost weigh as much or more (measured on 2 ranks sharing this VM's
2 cores with other work: fp32 270-780 ms a step, Horovod fp16 480-780 ms,
onebit 240-420 ms, as that load varied). Still the model trains to ~0.97 in
seconds of compute.

The defaults, --lr=0.02 and --epochs=12, were tuned briefly (one process,
batch 64 and 128, i.e. 2 and 4 ranks of 32): fp32 reaches 0.96-0.97 test
accuracy by epoch 7-10 on both. 0.05 gets fp32 there a little sooner (0.97
by epoch 5 at batch 64), but two-way onebit then oscillates between 0.90 and
0.96 (final 0.93 after 10 epochs on 2 ranks); at 0.02 it stays within
0.94-0.975 after epoch 3. The test split has 360 images, so one evaluation
moves by 1/360 = 0.0028 per image; a model near convergence still moves by
about 0.01 between evaluations, which is why the target has a margin, and
why the clock stops at a sustained accuracy (below).

Every method trains with the same seed (the same initial weights on every
rank and in every run), the same shards and data order, the same batch per
rank (--batch_size) and SGD(--lr, momentum 0.9, nesterov), for --epochs epochs
or until --max_seconds of training clock have passed (checked at evaluations,
so all ranks stop together). Every --eval_every steps (and before the first
and after the last) rank 0 measures the test accuracy while the others wait;
then an allgather of the ranks' clocks is the barrier that restarts all ranks
together.

The clock: each rank adds up the wall-clock time of its steps (fetching the
batch, forward, backward, exchange, update), so evaluation, the barrier and
start-up are not counted; the training clock at an evaluation is the slowest
rank's sum. The first step traces and compiles the step function; it is a real
training step, but it counts as the run's median step instead of its own time.

All methods run for the whole budget (simpler than stopping early, and it
gives every method's final accuracy); the time to target is then read from the
logged curve: the training clock at the first evaluation where the mean of the
last --sustained evaluations (3: that one and the two before it) reaches the
target, so one lucky evaluation cannot stop it; exact to --eval_every steps. The target is, per
rate and N, the final test accuracy of --reference (Horovod's fp16, run first
in every network whether --methods lists it or not) minus --margin. Per rate,
the table shows for every N and method: the seconds to target, how many times
faster than Horovod fp16 and than Horovod fp32 in the same run (their seconds / this
one's; "never" where the method did not reach the target), the steps to
target, final accuracy and steps, the median step, and the bytes one worker
sends per step by the exchange's own accounting (as wire.py counts them).
Writes every run, curves included, to --out and the curves (test accuracy
against training seconds, one subplot per rate and N, the target as a dashed
line) to --plot.
"""
import json
import os
import pathlib
import socket
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_keras: the baselines are Horovod's Keras wrappers

from absl import app, flags  # noqa: E402

import launch  # noqa: E402
import netns  # noqa: E402
import results  # noqa: E402
import wire  # noqa: E402  (defines the flags shared with it)

flags.FLAGS.set_default("rates", ["1gbit", "10gbit"])
flags.FLAGS.set_default("methods", ["horovod_fp32", "horovod_fp16", "none", "fp16", "onebit", "topk", "powersgd"])
flags.FLAGS.set_default("timeout", 1800)
flags.FLAGS.set_default("out", "results/time_to_accuracy.json")
flags.DEFINE_enum("task", "transformer", ["transformer", "text", "digits"], "The task (see above).")
flags.DEFINE_list("layers", ["64", "4096", "4096", "1024", "10"], "digits: the MLP's widths, the 64 pixels first, "
                  "the 10 classes last; text: its hidden widths (all but the first and the last) are the MLP's.")
flags.DEFINE_float("lr", None, "The learning rate, the same for every method: digits, SGD's (momentum 0.9, "
                   "nesterov; default 0.02); transformer and text, AdamW's peak (default 2e-3 and 1e-3).")
flags.DEFINE_integer("epochs", None, "Epochs of every run (each rank sees its shard once an epoch; digits: 12, "
                     "transformer: 3, text: 1).")
flags.DEFINE_float("compression_warmup", None, "The fraction of steps every compressed method sends at full precision "
                   "first (hc.DistributedOptimizer's warmup_steps; transformer and text: 0.1, digits: the "
                   "library's default).")
flags.DEFINE_float("max_seconds", 1200, "Training-clock budget of a run, checked at evaluations.")
flags.DEFINE_integer("eval_every", None, "Steps between two test evaluations (digits: 5, transformer and text: 20).")
flags.DEFINE_integer("sustained", 3, "The clock stops where the mean of this many consecutive evaluations reaches "
                     "the target.")
flags.DEFINE_integer("seed", 0, "Seed of the weights, the split and the data order.")
flags.DEFINE_string("reference", "horovod_fp16", "The method whose final accuracy, less --margin, is the target; "
                    "it runs first, whether --methods lists it or not.")
flags.DEFINE_float("margin", 0.01, "Target = the reference's final test accuracy - margin.")
flags.DEFINE_string("plot", "results/time_to_accuracy.png", "launcher: the figure.")
FLAGS = flags.FLAGS
#: each task's defaults of --lr, --epochs, --eval_every and --compression_warmup
TASK_DEFAULTS = {"digits": dict(lr=0.02, epochs=12, eval_every=5),
                 "transformer": dict(lr=2e-3, epochs=3, eval_every=20, compression_warmup=0.1),
                 "text": dict(lr=1e-3, epochs=1, eval_every=20, compression_warmup=0.1)}
#: the text task: characters of context, each embedded in EMBEDDING numbers; a window starts every TEXT_STRIDE
#: characters (so every character is one window's target once); the last TEXT_TEST_CHARS are the test set
TEXT_CONTEXT, EMBEDDING, TEXT_STRIDE, TEXT_TEST_CHARS = launch.TEXT_CONTEXT, launch.EMBEDDING, 24, 5_000


def setting(name):
    """--<name>, or the task's default (None where it has none)."""
    value = getattr(FLAGS, name)
    return TASK_DEFAULTS[FLAGS.task].get(name) if value is None else value


def make_optimizer(hc, hvd_keras, keras, base_optimizer, total_steps):
    """--method's optimizer around base_optimizer, and its accounting (wire.make_optimizer's); a compressed
    method sends at full precision for the first --compression_warmup of total_steps (the local-step methods,
    which send nothing between syncs, have no such warm-up)."""
    fraction = setting("compression_warmup")
    warmup = ({} if fraction is None or FLAGS.method.startswith("horovod_")
              or wire.is_local_steps(FLAGS.method) else
              dict(warmup_steps=max(1, int(fraction * total_steps))))
    return wire.make_optimizer(hc, hvd_keras, keras, FLAGS.method, base_optimizer, **warmup)


def digits_task(keras, hvd, hvd_keras, hc):
    """(model, optimizer, accounted, batches, steps per epoch, test inputs, test labels) of the wide MLP."""
    import digits
    (x_train, y_train), (x_test, y_test) = digits.load(FLAGS.seed)
    data, steps_per_epoch = digits.shard(x_train.reshape(len(x_train), -1), y_train, hvd.rank(), hvd.size(),
                                         FLAGS.batch_size, FLAGS.seed)
    model = launch.mlp(keras, [int(width) for width in FLAGS.layers])
    opt, accounted = make_optimizer(hc, hvd_keras, keras, keras.optimizers.SGD(setting("lr"), momentum=0.9,
                                                                                nesterov=True),
                                    setting("epochs") * steps_per_epoch)
    return model, opt, accounted, iter(data), steps_per_epoch, x_test.reshape(len(x_test), -1), y_test


def text_task(keras, hvd, hvd_keras, hc):
    """The same for the wide MLP on the next character of Python's documentation, under AdamW."""
    import digits
    import transformer
    from pydoc_text import character_codes, next_character
    codes, vocab_size = character_codes()
    x, y = next_character(codes[:-TEXT_TEST_CHARS], TEXT_CONTEXT, TEXT_STRIDE)
    x_test, y_test = next_character(codes[-TEXT_TEST_CHARS - TEXT_CONTEXT:], TEXT_CONTEXT, 1)
    data, steps_per_epoch = digits.shard(x, y, hvd.rank(), hvd.size(), FLAGS.batch_size, FLAGS.seed)
    hidden = [int(width) for width in FLAGS.layers[1:-1]]
    model = launch.text_mlp(keras, vocab_size, hidden)
    total = setting("epochs") * steps_per_epoch
    opt, accounted = make_optimizer(hc, hvd_keras, keras, transformer.adamw(keras, total, lr=setting("lr")), total)
    return model, opt, accounted, iter(data), steps_per_epoch, x_test, y_test


def transformer_task(keras, hvd, hvd_keras, hc):
    """The same for examples/transformer.py's causal transformer under AdamW."""
    import digits
    import transformer
    (x, y), (x_test, y_test), vocab_size = transformer.load_text()
    data, steps_per_epoch = digits.shard(x, y, hvd.rank(), hvd.size(), FLAGS.batch_size, FLAGS.seed)
    model = transformer.transformer(keras, vocab_size)
    total = setting("epochs") * steps_per_epoch
    opt, accounted = make_optimizer(hc, hvd_keras, keras, transformer.adamw(keras, total, lr=setting("lr")), total)
    return model, opt, accounted, iter(data), steps_per_epoch, x_test, y_test


def worker():
    import hvd_compress as hc
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    sys.path.insert(0, str(wire.REPO / "examples"))
    keras = hc.require_legacy_keras()
    hvd.init(process_sets="dynamic")  # (wire.py's hier_ methods make the hosts' process sets)
    tf.keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights on every rank
    task = {"digits": digits_task, "transformer": transformer_task, "text": text_task}[FLAGS.task]
    model, opt, accounted, batches, steps_per_epoch, x_test, y_test = task(keras, hvd, hvd_keras, hc)
    x_test, y_test = tf.constant(x_test), tf.constant(y_test, tf.int64)
    train = launch.training_step(keras, model, opt)
    test_accuracy = tf.function(lambda: tf.reduce_mean(tf.cast(tf.argmax(model(x_test), -1) == y_test, tf.float32)))

    def evaluate(clock):
        """(the slowest rank's clock, rank 0's test accuracy or None); all ranks leave it together."""
        accuracy = float(test_accuracy()) if hvd.rank() == 0 else None
        clocks = hvd.allgather(tf.constant([clock], tf.float64), name="tta.clock").numpy()
        return float(clocks.max()), accuracy

    total_steps = setting("epochs") * steps_per_epoch
    step_seconds, curve = [], [(0, 0.0, evaluate(0.0)[1])]  # (step, training clock without step 1, acc)
    auto = getattr(opt, "hc_auto", None)  # Compression.auto(): it calibrates, decides, and the step is retraced
    for step in range(1, total_steps + 1):
        start, batch = time.perf_counter(), next(batches)
        if auto is None:
            train(*batch).numpy()
        elif auto.train_step(opt, model.trainable_variables, lambda: train(*batch).numpy())[1]:
            train = launch.training_step(keras, model, opt)  # (its tracing counts in the next step's time)
        step_seconds.append(time.perf_counter() - start)
        if step % setting("eval_every") == 0 or step == total_steps:
            clock, accuracy = evaluate(sum(step_seconds[1:]))
            curve.append((step, clock, accuracy))
            if clock >= FLAGS.max_seconds:
                break
    params = int(sum(v.shape.num_elements() for v in model.trainable_variables))
    pathlib.Path(FLAGS.result.format(rank=hvd.rank())).write_text(json.dumps(dict(
        rank=hvd.rank(), size=hvd.size(), hostname=socket.gethostname(), params=params,
        steps_per_epoch=steps_per_epoch, steps=len(step_seconds), first_step_s=step_seconds[0],
        median_step_s=statistics.median(step_seconds[1:] or step_seconds), accounted=accounted(params),
        choice=auto and auto.decision, curve=curve)))


# -- launcher -------------------------------------------------------------------------------------
def run(net, method):
    """One method's training on net's ranks: its curve, as rank 0 measured it, and its figures."""
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--role=worker", f"--method={method}",
            f"--task={FLAGS.task}", f"--layers={','.join(FLAGS.layers)}", f"--lr={setting('lr')}",
            f"--epochs={setting('epochs')}", f"--max_seconds={FLAGS.max_seconds}",
            f"--eval_every={setting('eval_every')}", f"--seed={FLAGS.seed}", f"--batch_size={FLAGS.batch_size}",
            *([] if setting("compression_warmup") is None else [f"--compression_warmup={setting('compression_warmup')}"])]
    ranks = launch.run_in_namespaces(net, argv, FLAGS.timeout, f"{method} on {net.layout} ranks at {net.rate}",
                                     launcher=FLAGS.launcher, tf_cpu_allocator=FLAGS.tf_cpu_allocator,
                                     point_to_point=launch.needs_mpi(method))
    # The first step is counted as the median step of the slowest rank, not as its tracing time.
    first_step = max(r["median_step_s"] for r in ranks)
    curve = [dict(step=step, seconds=clock + (first_step if step else 0.0), accuracy=accuracy)
             for step, clock, accuracy in ranks[0]["curve"]]
    return dict(rate=net.rate, ranks=net.num_ranks, layout=net.layout, method=method, task=FLAGS.task,
                launcher=FLAGS.launcher, tf_cpu_allocator=FLAGS.tf_cpu_allocator, sustained=FLAGS.sustained,
                params=ranks[0]["params"], curve=curve, choice=ranks[0]["choice"],  # Compression.auto()'s
                final_accuracy=curve[-1]["accuracy"], steps=ranks[0]["steps"], seconds=curve[-1]["seconds"],
                median_step_s=first_step, accounted=statistics.fmean(r["accounted"] for r in ranks),
                steps_per_epoch=ranks[0]["steps_per_epoch"], first_step_s=[r["first_step_s"] for r in ranks],
                hostnames=[r["hostname"] for r in ranks])


def sustained_at(curve, target, k):
    """The first point of `curve` where the mean accuracy of it and the k - 1 points before it reaches
    `target` (None if none does)."""
    for i in range(k - 1, len(curve)):
        if sum(point["accuracy"] for point in curve[i - k + 1:i + 1]) / k >= target:
            return curve[i]
    return None


def add_time_to_target(runs):
    """Adds target, seconds_to_target and steps_to_target (None where it was never reached) to every
    run, and vs_<reference> and vs_fp32 (against horovod_fp32): their seconds to target / this one's,
    measured in the same network (None where either never reached it or did not run)."""
    network = lambda r: (r["rate"], wire.layout_of(r))  # noqa: E731
    for r in runs:
        same = {x["method"]: x for x in runs if network(x) == network(r)}
        r["target"] = same[FLAGS.reference]["final_accuracy"] - FLAGS.margin
        reached = sustained_at(r["curve"], r["target"], FLAGS.sustained)
        r["seconds_to_target"] = reached["seconds"] if reached else None
        r["steps_to_target"] = reached["step"] if reached else None
    for r in runs:
        same = {x["method"]: x for x in runs if network(x) == network(r)}
        for key, baseline in ((FLAGS.reference, FLAGS.reference), ("fp32", "horovod_fp32")):
            theirs = same.get(baseline, {}).get("seconds_to_target")
            ours = r["seconds_to_target"]  # 0 where the untrained model already reaches the target
            r[f"vs_{key}"] = theirs / ours if theirs is not None and ours else None


def print_table(rate, runs):
    print(f"\n### {rate}\n")
    for layout in dict.fromkeys(map(wire.layout_of, runs)):
        target = next(r["target"] for r in runs if wire.layout_of(r) == layout)
        print(f"- hosts {layout}: target {target:.4f} = {FLAGS.reference}'s final test accuracy - {FLAGS.margin}")
    print(f"\n| hosts | method | seconds to target | vs {launch.label(FLAGS.reference)} | vs {launch.label('horovod_fp32')} "
          "| steps to target | final accuracy | steps | median step ms | accounted bytes/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for r in runs:
        reached = r["seconds_to_target"] is not None
        seconds, steps = (f"{r['seconds_to_target']:.1f}", r["steps_to_target"]) if reached else ("never", "-")
        print(f"| {wire.layout_of(r)} | {wire.method_label(r)} | {seconds} | {ratio(r[f'vs_{FLAGS.reference}'])} "
              f"| {ratio(r['vs_fp32'])} | {steps} | {r['final_accuracy']:.4f} | {r['steps']} "
              f"| {1000 * r['median_step_s']:.0f} | {r['accounted']:,.0f} |")


def plot(runs, path):
    groups = sorted({(r["rate"], wire.layout_of(r)) for r in runs}, key=lambda g: (netns.rate_bits(g[0]), g[1]))
    fig, axes = results.figure(len(groups))
    for ax, (rate, layout) in zip(getattr(axes, "flat", [axes]), groups):
        group = [r for r in runs if (r["rate"], wire.layout_of(r)) == (rate, layout)]
        for r in group:
            ax.plot([p["seconds"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], marker=".",
                    markersize=3, label=r["method"])
        target = group[0]["target"]
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set(xlabel="training seconds (evaluation not counted)", ylabel="test accuracy",
               ylim=(min(0.8, target - 0.05), 1.0), title=f"{rate}, hosts {layout}")
        ax.legend(fontsize=8)
    results.save_figure(fig, path)


def main(_):
    if FLAGS.role == "worker":
        return worker()
    methods = [FLAGS.reference] + [m for m in FLAGS.methods if m != FLAGS.reference]  # the target first
    launch.check_names("time_to_accuracy.py", "methods", methods,
                       wire.METHODS)
    launch.check_launcher("time_to_accuracy.py", methods, FLAGS.launcher)
    if FLAGS.task == "digits" and (len(FLAGS.layers) < 2 or FLAGS.layers[0] != "64" or FLAGS.layers[-1] != "10"):
        sys.exit(f"time_to_accuracy.py: --layers must start with 64 (pixels) and end with 10 (classes), "
                 f"got {FLAGS.layers}.")
    network_layouts = wire.layouts()
    launch.prepare_network_run("time_to_accuracy.py", FLAGS.rates)
    quiet = launch.load_before()
    runs = []
    for rate in FLAGS.rates:
        for layout in network_layouts:
            with netns.Network(layout, rate, FLAGS.slow_start_after_idle) as net:
                for method in methods:
                    runs.append(run(net, method))
                    r = runs[-1]
                    print(f"{rate} {net.layout} {method}: test accuracy {r['final_accuracy']:.4f} after {r['steps']} steps, "
                          f"{r['seconds']:.1f} s of training (median step {1000 * r['median_step_s']:.0f} ms, "
                          f"accounted {r['accounted']:,.0f} B/step)", flush=True)
    add_time_to_target(runs)
    for rate in FLAGS.rates:
        print_table(rate, [r for r in runs if r["rate"] == rate])
    print(f"\n{describe(runs[0])}, at most {setting('epochs')} epochs or {FLAGS.max_seconds:g} s of training, test "
          f"accuracy every {setting('eval_every')} steps (not timed), seed {FLAGS.seed}, {os.cpu_count()} CPU cores "
          f"shared by the ranks; {quiet}.")
    print(f"\nReproduce with:\n    {command_line()}")
    results.save(FLAGS.out, runs)
    publish(runs)
    plot(runs, FLAGS.plot)


def describe(r):
    """The task of run r in words."""
    task, fraction = r.get("task", "digits"), setting("compression_warmup")
    warmup = "" if fraction is None else f"; compressed methods at full precision for their first {fraction:.0%} of steps"
    if task == "digits":
        return (f"{r['params']:,} parameters ({'-'.join(FLAGS.layers)} MLP on digits), batch {FLAGS.batch_size} per rank, "
                f"SGD lr {setting('lr')} (momentum 0.9, nesterov){warmup}")
    adamw = f"AdamW peak lr {setting('lr')} (warm-up into a cosine decay, clipping){warmup}"
    if task == "text":
        return (f"{r['params']:,} parameters (the next character of Python's documentation: {TEXT_CONTEXT} characters, "
                f"each embedded in {EMBEDDING} numbers, then a {'-'.join(FLAGS.layers[1:-1])} MLP), "
                f"{TEXT_TEST_CHARS:,} held-out characters to test, batch {FLAGS.batch_size} per rank, {adamw}")
    return f"causal transformer, {r['params']:,} parameters, batch {FLAGS.batch_size} sequences per rank, float32, {adamw}"


def command_line():
    layout = dict(hosts=FLAGS.hosts) if FLAGS.hosts else dict(ranks=FLAGS.ranks)
    return launch.command_line(__file__, task=FLAGS.task, rates=FLAGS.rates, **layout, methods=FLAGS.methods,
                               layers=FLAGS.layers, lr=setting("lr"), epochs=setting("epochs"),
                               **({} if setting("compression_warmup") is None else
                                  dict(compression_warmup=setting("compression_warmup"))),
                               max_seconds=FLAGS.max_seconds, tf_cpu_allocator=FLAGS.tf_cpu_allocator,
                               eval_every=setting("eval_every"), sustained=FLAGS.sustained,
                               batch_size=FLAGS.batch_size, seed=FLAGS.seed,
                               reference=FLAGS.reference, margin=FLAGS.margin,
                               slow_start_after_idle=FLAGS.slow_start_after_idle, launcher=FLAGS.launcher,
                               timeout=FLAGS.timeout,
                               out=FLAGS.out, plot=FLAGS.plot)



def render(runs):
    """One host layout's runs as docs/benchmarks.md shows them: every link, ratios taken in the same network."""
    reference = next(key[3:] for key in runs[0] if key.startswith("vs_") and key != "vs_fp32")
    name = launch.label(reference)
    targets = "; ".join(f"{rate}: {r['target']:.4f}" for rate, r in {r["rate"]: r for r in runs}.items())
    r0 = runs[0]
    hosts = "" if wire.layout_of(r0).endswith("x1") else f" on hosts {wire.layout_of(r0)} (sharing a host's link)"
    note = (f"{r0['ranks']} ranks{hosts}, {launch.launched(r0.get('launcher', 'gloo'))}, {launch.allocator_note(r0)}, "
            f"{describe(r0)}. "
            f"Target: {name}'s final test accuracy less the margin "
            f"({targets}). Seconds: the slowest rank's training clock at the first evaluation where the mean of the "
            f"last {r0.get('sustained', 1)} evaluations reaches the target.")
    if any(r["method"] == wire.NO_EXCHANGE for r in runs):
        note += (f" {wire.NO_EXCHANGE}: each rank trains alone on its shard and sends nothing; its median step is "
                 "the floor (the step's compute and the optimizer's own update), its accuracy rank 0's alone, so it "
                 "has no time to the target.")
    rows = []
    for r in runs:
        if r["method"] == wire.NO_EXCHANGE:
            rows.append([r["rate"], r["method"], "(floor)", "-", "-", "-", f"{r['final_accuracy']:.4f}",
                         f"{1000 * r['median_step_s']:.0f}", results.count(r["accounted"])])
            continue
        reached = r["seconds_to_target"] is not None
        rows.append([r["rate"], wire.method_label(r), f"{r['seconds_to_target']:.1f}" if reached else "never",
                     results.times(r[f"vs_{reference}"]), results.times(r["vs_fp32"]),
                     r["steps_to_target"] if reached else "-", f"{r['final_accuracy']:.4f}",
                     f"{1000 * r['median_step_s']:.0f}", results.count(r["accounted"])])
    table = results.markdown_table(["link", "method", "seconds to target", f"vs {name}", "vs Horovod fp32",
                                    "steps to target",
                                    "final accuracy", "median step ms", "bytes/step/worker"], rows,
                                   align=["l", "l"] + ["r"] * 7)
    return f"{note}\n\n{table}"


def publish(runs):
    """The table of each host layout in docs/benchmarks.md: time_to_accuracy_<task>_<n>ranks for n hosts of one
    rank, time_to_accuracy_<task>_hosts_<HxL> for hosts of several; with _mpi after it for an MPI launch."""
    for layout in dict.fromkeys(map(wire.layout_of, runs)):
        mine = [r for r in runs if wire.layout_of(r) == layout]
        name = f"{mine[0]['ranks']}ranks" if layout.endswith("x1") else f"hosts_{layout}"
        results.publish(f"time_to_accuracy_{runs[0].get('task', 'digits')}_{name}{launch.table_suffix(mine[0])}",
                        render(mine), results.command_line(), source=FLAGS.out)


def per_task_paths(argv):
    """--out and --plot left at their defaults name the task and an MPI launch:
    results/time_to_accuracy_<task>[_mpi].json (.png)."""
    launched = launch.table_suffix(dict(launcher=FLAGS.launcher))
    for name, suffix in (("out", "json"), ("plot", "png")):
        if FLAGS[name].using_default_value:
            setattr(FLAGS, name, f"results/time_to_accuracy_{FLAGS.task}{launched}.{suffix}")
    return results.run(main, publish)(argv)


if __name__ == "__main__":
    app.run(per_task_paths)
