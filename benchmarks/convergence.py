"""Convergence of every method: final test accuracy and accuracy versus bytes, on the bundled digits
(SGD) or on the causal transformer (AdamW, mixed_float16).

    .venv/bin/python benchmarks/convergence.py            # digits: 2 ranks, 16 epochs, seed 0
    .venv/bin/python benchmarks/convergence.py --task=transformer   # 2 ranks, 3 epochs, seeds 0, 1, 2 (about an hour)

    .venv/bin/python benchmarks/convergence.py --task=text --launcher=mpi --ranks=3 \
        --text_methods=none,sgp,sgp_overlap_mpi        # the character model, SGD; SGP point to point

The text task runs examples/keras_text.py (the character model with an Embedding under mixed_float16,
momentum SGD) for every method and seed, launched with Gloo or MPI (--launcher; SGP's point-to-point
variants need MPI): mean and per-seed test accuracy against none's (allreduce SGD) and bytes per step
(table convergence_text_<n>ranks, _mpi when launched with MPI).

The transformer task runs examples/keras_transformer.py (--method=<name>: AdamW with a warm-up into
a cosine decay, clipping, mixed_float16; onebit is 1-bit Adam there) for every method and seed and
writes the mean and every seed's test accuracy, the difference to none's (uncompressed AdamW) and
the bytes one worker sends per compressed step (table convergence_transformer).

Runs examples/keras_digits.py (and examples/keras_accordion.py for Accordion)
under horovodrun (Gloo) with the same seed, epochs, batch and learning rate,
for methods by hc.methods' names (keras_digits.py --compression=<name>; none
is Horovod's fp32 allreduce in our wrapper) and `accordion` (PowerSGD rank
4 <-> 1), prints a markdown table (final test accuracy, bytes one worker sent,
and the ratio to none's, Horovod's fp32 allreduce), writes results/convergence.json and
draws docs/img/convergence.png (test accuracy against bytes and epochs).
SGP's per-epoch accuracy is rank 0's own model; its final one the consensus.
"""

import sys

from absl import app, flags

import launch
import results
from hvd_compress import methods as registry

flags.DEFINE_enum("task", "digits", ["digits", "transformer", "text"], "The task.")
flags.DEFINE_enum("launcher", "gloo", launch.LAUNCHERS, "How the text task's ranks start (mpi for SGP's "
                  "point-to-point variants; the other tasks launch with Gloo).")
flags.DEFINE_integer("ranks", 2, "Ranks.")
flags.DEFINE_integer("epochs", None, "Epochs of every run (digits: 16, transformer: 3, text: 2).")
flags.DEFINE_integer("seed", 0, "Seed of every run (digits).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of every run (transformer, text).")
flags.DEFINE_list("text_methods", ["none", "sgp", "sgp_overlap"],
                  "Methods of the text task: names of hc.methods, or of launch.GOSSIP_VARIANTS (SGP's variants).")
flags.DEFINE_list("transformer_methods", ["none", "onebit", "onebit_oneway_b256", "onebit_oneway_b256_wu10",
                                          "onebit_oneway_b256_wu6", "topk", "powersgd", "topk_10pct", "powersgd_rank16",
                                          "randomk_10pct"],
                  "Methods of the transformer task: names of hc.methods that examples/keras_transformer.py takes, "
                  "or of TRANSFORMER_VARIANTS.")
flags.DEFINE_list("methods", ["none", "fp16", "onebit", "onebit_oneway", "quantize8", "quantize4", "topk", "randomk",
                              "sketch", "fetchsgd", "powersgd", "sgp", "accordion"],
                  "Methods: names of hc.methods that examples/keras_digits.py takes, or accordion.")
flags.DEFINE_string("out", "results/convergence.json", "The runs' JSON.")
flags.DEFINE_string("plot", "docs/img/convergence.png", "The figure.")
FLAGS = flags.FLAGS

BASELINE = "none"  # Horovod's fp32 allreduce in hc.DistributedOptimizer
#: keras_digits.py's flags that change a method's defaults in hc.methods, for this benchmark
OVERRIDES = {"randomk": ["--ratio=0.1"]}
#: this benchmark's runs that are not a method of hc.methods: name -> (example script, its flags)
OTHER_RUNS = {"accordion": ("keras_accordion.py", ["--mode=accordion", "--family=powersgd"])}
#: the transformer task's runs of a method at other settings than hc.methods' defaults: name -> the example's flags
#: (the settings that keep AdamW's accuracy, which the compressors' under_adam notes cite)
TRANSFORMER_VARIANTS = {"onebit_oneway_b256": ["--method=onebit_oneway", "--block_size=256"],
                        "onebit_oneway_b256_wu10": ["--method=onebit_oneway", "--block_size=256",
                                                    "--compression_warmup=0.1"],
                        "onebit_oneway_b256_wu6": ["--method=onebit_oneway", "--block_size=256",
                                                   "--compression_warmup=0.06"],
                        "topk_10pct": ["--method=topk", "--topk_ratio=0.1"],
                        "powersgd_rank16": ["--method=powersgd", "--powersgd_rank=16"],
                        "randomk_10pct": ["--method=randomk", "--topk_ratio=0.1"]}


def example(method):
    """(example script, its flags) that run `method`."""
    if method in OTHER_RUNS:
        return OTHER_RUNS[method]
    return "keras_digits.py", [f"--compression={method}", *OVERRIDES.get(method, [])]


def plot(runs, path):
    fig, (by_bytes, by_epoch) = results.figure(2, width=6.5)
    for method, r in runs.items():
        megabytes = [e["cumulative_bytes"] / 1e6 for e in r["epochs"]]
        accuracy = [e["test_accuracy"] for e in r["epochs"]]
        by_bytes.plot(megabytes, accuracy, marker=".", label=launch.label(method))
        by_epoch.plot(range(1, len(accuracy) + 1), accuracy, marker=".", label=launch.label(method))
    by_bytes.set(xscale="log", xlabel="MB sent per worker (log)", ylabel="test accuracy", ylim=(0.85, 1.0),
                 title=f"digits CNN, {FLAGS.ranks} ranks: accuracy versus bytes")
    by_epoch.set(xlabel="epoch", ylabel="test accuracy", ylim=(0.85, 1.0), title="accuracy per epoch")
    by_bytes.legend(fontsize=8)
    results.save_figure(fig, path)

def transformer(_):
    """Every method and seed on examples/keras_transformer.py; the table convergence_transformer."""
    launch.check_names("convergence.py", "transformer_methods", FLAGS.transformer_methods,
                       [name for name in registry.NAMES if name != "sgp" and name not in registry.LOCAL_STEP_METHODS]
                       + list(TRANSFORMER_VARIANTS))
    runs = run_seeds("keras_transformer.py", {method: TRANSFORMER_VARIANTS.get(method, [f"--method={method}"])
                                              for method in FLAGS.transformer_methods}, FLAGS.epochs or 3, timeout=2400)
    print(render_transformer(runs))
    results.save(out(), runs)
    publish_transformer(runs)


def text(_):
    """Every method and seed on examples/keras_text.py; the table convergence_text_<n>ranks(_mpi)."""
    launch.check_names("convergence.py", "text_methods", FLAGS.text_methods,
                       [*(name for name in registry.NAMES if name not in registry.LOCAL_STEP_METHODS),
                        *launch.GOSSIP_VARIANTS])
    launch.check_launcher("convergence.py", FLAGS.text_methods, FLAGS.launcher)
    runs = run_seeds("keras_text.py", {method: launch.example_flags(method) for method in FLAGS.text_methods},
                     FLAGS.epochs or 2, json_flag="result", launcher=FLAGS.launcher)
    print(render_text(runs))
    results.save(out(), runs)
    publish_text(runs)


def run_seeds(script, methods, epochs, launcher="gloo", **run_example_kwargs):
    """{method: rank 0's JSON of each seed, with the launcher}: examples/<script> on --ranks ranks launched with
    `launcher` for every method (name -> the example's flags) and seed of --seeds, for `epochs`."""
    runs = {}
    for method, method_flags in methods.items():
        runs[method] = [dict(launch.run_example(script, FLAGS.ranks, [*method_flags, f"--epochs={epochs}",
                                                                      f"--seed={seed}"], launcher=launcher,
                                                **run_example_kwargs), launcher=launcher) for seed in FLAGS.seeds]
        print(f"{method}: test accuracy {[r['test_accuracy'] for r in runs[method]]}, "
              f"{runs[method][0]['bytes_per_step']:,.0f} B/step", flush=True)
    return runs


#: the headers of seed_columns' first four columns (the last two: bytes, named by the table)
SEED_COLUMNS = ["method", "mean test accuracy", "per seed", "points vs none"]


def seed_columns(runs):
    """Per method of run_seeds' runs: its name, mean and per-seed test accuracy, points against none's, bytes one
    worker sends per step (after any full-precision steps) and none's over them."""
    baseline = runs.get(BASELINE)
    mean = {method: sum(r["test_accuracy"] for r in seeds) / len(seeds) for method, seeds in runs.items()}
    return {method: [method, f"{mean[method]:.4f}", ", ".join(f"{r['test_accuracy']:.4f}" for r in seeds),
                     f"{100 * (mean[method] - mean[BASELINE]):+.2f}" if baseline else "-",
                     results.count(seeds[0]["bytes_per_step"]),
                     f"{baseline[0]['bytes_per_step'] / seeds[0]['bytes_per_step']:.1f}x" if baseline else "-"]
            for method, seeds in runs.items()}


def render_text(runs):
    """Mean and per-seed test accuracy, points against none's (allreduce SGD), bytes per step."""
    first = next(iter(runs.values()))[0]
    note = (f"character model with an Embedding (examples/keras_text.py), {first['parameters']:,} parameters, "
            f"{first['ranks']} ranks {launch.launched(first.get('launcher', 'gloo'))}, {first['steps']} steps, "
            f"{first['policy']}, "
            f"SGD with Nesterov momentum; sgp: PushSumOptimizer (the consensus model, averaged once at fit's end), "
            f"_overlap with each message mixed in a step later, _mpi sent point to point. Bytes: what one worker "
            f"sends per step.")
    table = results.markdown_table([*SEED_COLUMNS, "bytes/step/worker", "none / method"],
                                   list(seed_columns(runs).values()))
    return f"{note}\n\n{table}"


def publish_text(runs):
    first = next(iter(runs.values()))[0]
    results.publish(f"convergence_text_{first['ranks']}ranks{launch.table_suffix(first)}", render_text(runs),
                    results.command_line(), source=out())


def render_transformer(runs):
    """Mean and per-seed test accuracy, points against none's (uncompressed AdamW), bytes per step."""
    first = next(iter(runs.values()))[0]
    baseline = runs.get(BASELINE)
    note = (f"causal transformer (examples/keras_transformer.py), {first['parameters']:,} parameters, {first['ranks']} "
            f"ranks, {first['steps']} steps, {first['policy']}, AdamW with a warm-up into a cosine decay and "
            f"global-norm clipping; the compressed methods start after 15% of the steps at full precision (onebit: "
            f"1-bit Adam; the others: error feedback on gradients, Adam's variance frozen after the warm-up); "
            f"onebit_oneway_b256 is 1-bit Adam one-way with a scale per 256 elements, and _wu10 and _wu6 the same "
            f"with 10% (as long as the learning rate's warm-up) and 6% of the steps at full precision; topk, randomk "
            f"and powersgd at hc.methods' defaults (1% of the coordinates, rank 4), "
            f"topk_10pct, randomk_10pct and powersgd_rank16 at 10% and rank 16. Accuracy: next-character accuracy on "
            f"65,000 held-out characters; bytes: what one worker sends per step after the full-precision steps, and "
            f"over the whole run with them.")
    columns = seed_columns(runs)
    rows = [[*columns[method], f"{seeds[0]['bytes_per_run'] / 1e6:,.1f}" if "bytes_per_run" in seeds[0] else "-",
             f"{baseline[0]['bytes_per_run'] / seeds[0]['bytes_per_run']:.1f}x"
             if baseline and "bytes_per_run" in seeds[0] else "-"]
            for method, seeds in runs.items()]
    table = results.markdown_table([*SEED_COLUMNS, "bytes/compressed step/worker", "none / method, compressed step",
                                    "MB per run/worker", "none / method, run"], rows)
    return f"{note}\n\n{table}"


def publish_transformer(runs):
    results.publish("convergence_transformer", render_transformer(runs), results.command_line(), source=out())


def out():
    """--out, or with --out left at its default, results/convergence_transformer.json for the transformer task
    and results/convergence_text_<n>ranks(_mpi).json for the text task."""
    if not FLAGS["out"].using_default_value or FLAGS.task == "digits":
        return FLAGS.out
    if FLAGS.task == "transformer":
        return "results/convergence_transformer.json"
    return f"results/convergence_text_{FLAGS.ranks}ranks{'_mpi' if FLAGS.launcher == 'mpi' else ''}.json"


def main(_):
    if FLAGS.task != "text" and FLAGS.launcher != "gloo":
        sys.exit(f"convergence.py: --launcher={FLAGS.launcher} applies to --task=text only; the {FLAGS.task} task "
                 "launches with Gloo: drop --launcher.")
    if FLAGS.task in TASKS:
        return TASKS[FLAGS.task][0](_)
    launch.check_names("convergence.py", "methods", FLAGS.methods,
                       [*(name for name in registry.NAMES if not name.startswith("horovod_")), *OTHER_RUNS])
    runs = {}
    for method in FLAGS.methods:
        script, method_flags = example(method)
        runs[method] = launch.run_example(script, FLAGS.ranks, method_flags + [
            f"--epochs={FLAGS.epochs or 16}", f"--seed={FLAGS.seed}"])
        print(f"{method}: test accuracy {runs[method]['test_accuracy']:.4f}, "
              f"{runs[method]['total_bytes'] / 1e6:.3f} MB", flush=True)
    fp32 = runs.get(BASELINE)
    print(f"\n{FLAGS.ranks} ranks, {FLAGS.epochs or 16} epochs, seed {FLAGS.seed}\n\n"
          f"| method | final test accuracy | MB sent per worker | {launch.label(BASELINE)} bytes / method bytes |")
    print("|---|---:|---:|---:|")
    for method, r in runs.items():
        ratio = f"{fp32['total_bytes'] / r['total_bytes']:.1f}x" if fp32 else "-"
        print(f"| {method} | {r['test_accuracy']:.4f} | {r['total_bytes'] / 1e6:.3f} | {ratio} |")
    results.save(FLAGS.out, runs)
    publish(runs)
    plot(runs, FLAGS.plot)


def render(runs):
    """The runs as docs/benchmarks.md shows them: final test accuracy, bytes one worker sent, ratio to fp32."""
    fp32 = runs.get("none") or runs.get("fp32")  # fp32 allreduce (files from before hc.methods' names: fp32)
    first = next(iter(runs.values()))
    note = f"digits CNN, {first['ranks']} ranks, {len(first['epochs'])} epochs; bytes: those one worker sent over the run."
    table = results.markdown_table(
        ["method", "final test accuracy", "MB sent per worker", "fp32 bytes / method bytes"],
        [[method, f"{r['test_accuracy']:.4f}", f"{r['total_bytes'] / 1e6:.3f}",
          f"{fp32['total_bytes'] / r['total_bytes']:.1f}x" if fp32 else "-"] for method, r in runs.items()])
    return f"{note}\n\n{table}"


def publish(runs):
    """The table in docs/benchmarks.md: convergence_<n>ranks."""
    ranks = next(iter(runs.values()))["ranks"]
    results.publish(f"convergence_{ranks}ranks", render(runs), results.command_line(), source=FLAGS.out)


#: the tasks besides digits: name -> (its run, its publishing from the saved runs)
TASKS = {"transformer": (transformer, publish_transformer), "text": (text, publish_text)}

if __name__ == "__main__":
    app.run(lambda argv: TASKS[FLAGS.task][1](results.load(out())) if FLAGS.publish_only and FLAGS.task in TASKS
            else results.run(main, publish)(argv))
