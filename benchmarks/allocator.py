"""TensorFlow's CPU allocator under each example: the wall time of a short run with the default allocator and
with BFC, in the same run.

    .venv/bin/python benchmarks/allocator.py [--ranks=2] [--examples=keras_digits,keras_text]

TensorFlow's default CPU allocator takes every large tensor's memory afresh from the kernel, which faults in
each page on its first write; its BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=1) keeps the memory of freed tensors
and reuses it. For each example of EXAMPLES this runs `horovodrun -np --ranks -H localhost:--ranks --gloo
python examples/<example>.py <its short settings>` once with TF_CPU_ALLOCATOR_USE_BFC=0 and once with =1
(alternating, --repeats times), and reports the median wall time of the whole job (start-up, which both pay
alike, included) and the ratio. The examples set TF_CPU_ALLOCATOR_USE_BFC=1 unless the environment says
otherwise; here the environment says, so each run gets the allocator named. Writes --out and publishes the
table `allocator_examples` in docs/benchmarks.md. The step-level figures (wire.py, overhead.py with
--tf_cpu_allocator=default and bfc) are in the same document.
"""
import os
import pathlib
import statistics
import subprocess
import sys
import time

from absl import app, flags

import results

REPO = pathlib.Path(__file__).resolve().parent.parent
#: example -> the flags of a short run of it (one epoch, its default method)
EXAMPLES = {
    "keras_digits": ["--epochs=2"],
    "keras_accordion": ["--epochs=2"],
    "keras_text": ["--epochs=1", "--train_chars=100000"],
    "keras_transformer": ["--epochs=1"],
}
ALLOCATORS = {"default": "0", "bfc": "1"}

flags.DEFINE_list("examples", list(EXAMPLES), "Examples to run (names of EXAMPLES).")
flags.DEFINE_integer("ranks", 2, "Ranks of each job.")
flags.DEFINE_integer("repeats", 1, "Runs of each example with each allocator (the median is reported).")
flags.DEFINE_integer("timeout", 1200, "Seconds one job may take.")
flags.DEFINE_string("out", "results/allocator.json", "Where the figures go.")
FLAGS = flags.FLAGS


def wall_seconds(example, allocator):
    """One run of the example under horovodrun with this allocator: its wall time."""
    horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "-np", str(FLAGS.ranks), "-H", f"localhost:{FLAGS.ranks}", "--gloo", sys.executable,
           str(REPO / "examples" / f"{example}.py"), *EXAMPLES[example]]
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC=ALLOCATORS[allocator], TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, timeout=FLAGS.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=REPO)
    if done.returncode:
        tail = "\n".join(done.stdout.splitlines()[-20:])
        raise RuntimeError(f"{example} with the {allocator} allocator exited with {done.returncode}:\n{tail}")
    return time.perf_counter() - start


def render(figures):
    rows = [[name, " ".join(EXAMPLES.get(name, [])), f"{r['default']:.1f}", f"{r['bfc']:.1f}",
             f"{r['default'] / r['bfc']:.2f}x"] for name, r in figures["examples"].items()]
    note = (f"Each example under `horovodrun -np {figures['ranks']} --gloo` on this machine, its default method; "
            f"wall seconds of the whole job (start-up included), median of {figures['repeats']} run(s) per "
            "allocator, alternated. default: TF_CPU_ALLOCATOR_USE_BFC=0; bfc: =1.")
    table = results.markdown_table(["example", "flags", "default s", "bfc s", "default / bfc"], rows,
                                   align=["l", "l", "r", "r", "r"])
    return f"{note}\n\n{table}"


def publish(figures):
    results.publish("allocator_examples", render(figures), source=FLAGS.out)


def main(_):
    unknown = sorted(set(FLAGS.examples) - set(EXAMPLES))
    if unknown:
        sys.exit(f"--examples: unknown {unknown}; known: {sorted(EXAMPLES)}")
    figures = {"ranks": FLAGS.ranks, "repeats": FLAGS.repeats, "examples": {}}
    for example in FLAGS.examples:
        times = {name: [] for name in ALLOCATORS}
        for _ in range(FLAGS.repeats):
            for name in ALLOCATORS:
                times[name].append(wall_seconds(example, name))
                print(f"{example} {name}: {times[name][-1]:.1f} s", flush=True)
        figures["examples"][example] = {name: statistics.median(t) for name, t in times.items()}
    print("\n" + render(figures))
    results.save(FLAGS.out, figures)
    publish(figures)


if __name__ == "__main__":
    app.run(results.run(main, publish))
