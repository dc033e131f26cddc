"""Accordion beside static low and static high compression on the digits example.

    .venv/bin/python benchmarks/accordion.py            # 2 ranks, PowerSGD rank 4 <-> 1

Runs examples/keras_accordion.py under horovodrun (Gloo) with the same seed
and epochs for --mode low, high, accordion and batch (Accordion's batch size,
16 <-> 64 per rank, at PowerSGD rank 1), prints the final test accuracy and
the total bytes one worker sent (and their share of static low's), writes
results/accordion.json and draws docs/img/accordion.png: the regime of each
layer over the epochs, cumulative bytes, and test accuracy versus bytes.
"""

import numpy as np
from absl import app, flags

import launch
import results

flags.DEFINE_integer("ranks", 2, "Ranks.")
flags.DEFINE_enum("family", "powersgd", ["powersgd", "topk", "randomk", "sketch", "onebit"], "Compressor family.")
flags.DEFINE_integer("epochs", 16, "Epochs of every run.")
flags.DEFINE_list("lr_drops", [], "Epochs at which the learning rate drops 10x.")
flags.DEFINE_list("modes", ["low", "high", "accordion", "batch"], "Runs.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (split, initial weights, shuffling); the plot shows the first.")
flags.DEFINE_string("out", "results/accordion.json", "The runs' JSON.")
flags.DEFINE_string("plot", "docs/img/accordion.png", "The figure.")
FLAGS = flags.FLAGS

def run(mode, seed):
    return launch.run_example("keras_accordion.py", FLAGS.ranks, [
        f"--mode={mode}", f"--family={FLAGS.family}", f"--epochs={FLAGS.epochs}", f"--seed={seed}",
        f"--lr_drops={','.join(FLAGS.lr_drops)}"])

def plot(runs, path):
    fig, (regime, cumulative, accuracy) = results.figure(3, width=5)
    accordion = runs.get("accordion")
    if accordion:
        layers = sorted(k for k in accordion["epochs"][0] if k.startswith("accordion_critical/"))
        for j, key in enumerate(layers):
            critical = [e[key] for e in accordion["epochs"]]
            regime.step(range(1, len(critical) + 1), [j + 0.8 * c for c in critical], where="mid",
                        label=key.split("/", 1)[1])
        regime.set_yticks([j + 0.4 for j in range(len(layers))], [k.split("/", 1)[1] for k in layers])
        regime.set_title("Accordion: regime per layer (up = critical, low compression)")
        regime.set_xlabel("epoch")
    for mode, r in runs.items():
        megabytes = [e["cumulative_bytes"] / 1e6 for e in r["epochs"]]
        cumulative.plot(range(1, len(megabytes) + 1), megabytes, marker=".", label=mode)
        accuracy.plot(megabytes, [e["test_accuracy"] for e in r["epochs"]], marker=".", label=mode)
    cumulative.set(title="bytes sent per worker", xlabel="epoch", ylabel="MB")
    accuracy.set(title="test accuracy versus bytes", xlabel="MB sent per worker", ylabel="test accuracy",
                 ylim=(0.8, 1.0))
    cumulative.legend()
    accuracy.legend()
    results.save_figure(fig, path)

def main(_):
    runs = {mode: [] for mode in FLAGS.modes}
    for seed in FLAGS.seeds:
        for mode in FLAGS.modes:
            runs[mode].append(run(mode, seed))
            print(f"seed {seed}, {mode}: test accuracy {runs[mode][-1]['test_accuracy']:.4f}, "
                  f"{runs[mode][-1]['total_bytes'] / 1e6:.3f} MB", flush=True)
    mean = {mode: {key: float(np.mean([r[key] for r in rs])) for key in ("test_accuracy", "total_bytes")}
            for mode, rs in runs.items()}
    low = mean.get("low")
    print(f"\n{FLAGS.ranks} ranks, {FLAGS.family}, {FLAGS.epochs} epochs, learning-rate drops at "
          f"{FLAGS.lr_drops or 'none'}, seeds {','.join(FLAGS.seeds)}\n\n"
          "| run | test accuracy per seed | mean | vs static low | MB sent per worker | bytes vs static low |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, rs in runs.items():
        m, accuracies = mean[mode], " ".join(f"{r['test_accuracy']:.4f}" for r in rs)
        versus = f"{100 * (m['test_accuracy'] - low['test_accuracy']):+.2f} pt" if low else "-"
        share = f"{m['total_bytes'] / low['total_bytes']:.1%}" if low else "-"
        print(f"| {mode} | {accuracies} | "
              f"{m['test_accuracy']:.4f} | {versus} | {m['total_bytes'] / 1e6:.3f} | {share} |")
    results.save(FLAGS.out, runs)
    publish(runs)
    plot({mode: rs[0] for mode, rs in runs.items()}, FLAGS.plot)


def render(runs):
    """The runs as docs/benchmarks.md shows them: accuracy per seed and its mean, bytes, both against static low."""
    mean = {mode: {key: float(np.mean([r[key] for r in rs])) for key in ("test_accuracy", "total_bytes")}
            for mode, rs in runs.items()}
    low = mean.get("low")
    first = next(iter(runs.values()))[0]
    note = (f"digits CNN, {first['ranks']} ranks, {first['family']}, {len(first['epochs'])} epochs, "
            f"{len(next(iter(runs.values())))} seeds; bytes: those one worker sent over the run.")
    rows = []
    for mode, rs in runs.items():
        m = mean[mode]
        rows.append([mode, " ".join(f"{r['test_accuracy']:.4f}" for r in rs), f"{m['test_accuracy']:.4f}",
                     f"{100 * (m['test_accuracy'] - low['test_accuracy']):+.2f} pt" if low else "-",
                     f"{m['total_bytes'] / 1e6:.3f}", f"{m['total_bytes'] / low['total_bytes']:.1%}" if low else "-"])
    table = results.markdown_table(["run", "test accuracy per seed", "mean", "vs static low", "MB sent per worker",
                                    "bytes vs static low"], rows, align=["l", "l", "r", "r", "r", "r"])
    return f"{note}\n\n{table}"


def publish(runs):
    """The table in docs/benchmarks.md: accordion_<family>."""
    family = next(iter(runs.values()))[0]["family"]
    results.publish(f"accordion_{family}", render(runs), results.command_line(), source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
