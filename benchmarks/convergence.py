"""Convergence of every method on the bundled digits: final test accuracy and accuracy versus bytes.

    .venv/bin/python benchmarks/convergence.py            # 2 ranks, 16 epochs, seed 0

Runs examples/keras_digits.py (and examples/keras_accordion.py for Accordion)
under horovodrun (Gloo) with the same seed, epochs, batch and learning rate,
prints a markdown table (final test accuracy, bytes one worker sent, and the
ratio to Horovod's fp32 allreduce), writes results/convergence.json and
draws docs/img/convergence.png (test accuracy against bytes and epochs).
SGP's per-epoch accuracy is rank 0's own model; its final one the consensus.
"""

from absl import app, flags

import launch
import results

flags.DEFINE_integer("ranks", 2, "Ranks.")
flags.DEFINE_integer("epochs", 16, "Epochs of every run.")
flags.DEFINE_integer("seed", 0, "Seed of every run.")
flags.DEFINE_list("methods", ["fp32", "fp16", "onebit", "onebit_oneway", "topk", "randomk", "sketch", "powersgd",
                              "sgp", "accordion"], "Methods.")
flags.DEFINE_string("out", "results/convergence.json", "The runs' JSON.")
flags.DEFINE_string("plot", "docs/img/convergence.png", "The figure.")
FLAGS = flags.FLAGS

#: method -> (example script, its flags)
METHODS = {
    "fp32": ("keras_digits.py", ["--compression=none"]),
    "fp16": ("keras_digits.py", ["--compression=fp16"]),
    "onebit": ("keras_digits.py", ["--compression=onebit", "--two_way"]),
    "onebit_oneway": ("keras_digits.py", ["--compression=onebit", "--notwo_way"]),
    "topk": ("keras_digits.py", ["--compression=topk", "--ratio=0.01"]),
    "randomk": ("keras_digits.py", ["--compression=randomk", "--ratio=0.1"]),
    "sketch": ("keras_digits.py", ["--compression=sketch", "--sketch_ratio=4"]),
    "powersgd": ("keras_digits.py", ["--compression=powersgd", "--rank=4"]),
    "sgp": ("keras_digits.py", ["--compression=sgp"]),
    "accordion": ("keras_accordion.py", ["--mode=accordion", "--family=powersgd"]),
}

def plot(runs, path):
    fig, (by_bytes, by_epoch) = results.figure(2, width=6.5)
    for method, r in runs.items():
        megabytes = [e["cumulative_bytes"] / 1e6 for e in r["epochs"]]
        accuracy = [e["test_accuracy"] for e in r["epochs"]]
        by_bytes.plot(megabytes, accuracy, marker=".", label=method)
        by_epoch.plot(range(1, len(accuracy) + 1), accuracy, marker=".", label=method)
    by_bytes.set(xscale="log", xlabel="MB sent per worker (log)", ylabel="test accuracy", ylim=(0.85, 1.0),
                 title=f"digits CNN, {FLAGS.ranks} ranks: accuracy versus bytes")
    by_epoch.set(xlabel="epoch", ylabel="test accuracy", ylim=(0.85, 1.0), title="accuracy per epoch")
    by_bytes.legend(fontsize=8)
    results.save_figure(fig, path)

def main(_):
    runs = {}
    for method in FLAGS.methods:
        script, method_flags = METHODS[method]
        runs[method] = launch.run_example(script, FLAGS.ranks, method_flags + [
            f"--epochs={FLAGS.epochs}", f"--seed={FLAGS.seed}"])
        print(f"{method}: test accuracy {runs[method]['test_accuracy']:.4f}, "
              f"{runs[method]['total_bytes'] / 1e6:.3f} MB", flush=True)
    fp32 = runs.get("fp32")
    print(f"\n{FLAGS.ranks} ranks, {FLAGS.epochs} epochs, seed {FLAGS.seed}\n\n"
          "| method | final test accuracy | MB sent per worker | fp32 bytes / method bytes |")
    print("|---|---:|---:|---:|")
    for method, r in runs.items():
        ratio = f"{fp32['total_bytes'] / r['total_bytes']:.1f}x" if fp32 else "-"
        print(f"| {method} | {r['test_accuracy']:.4f} | {r['total_bytes'] / 1e6:.3f} | {ratio} |")
    results.save(FLAGS.out, runs)
    plot(runs, FLAGS.plot)

if __name__ == "__main__":
    app.run(main)
