"""How Horovod's background loop cycles while its rank computes and no collective is queued (rank 0's timeline,
cycles marked): Horovod's own loop cycles every HOROVOD_CYCLE_TIME (1 ms), this project's build waits for a
collective up to HOROVOD_IDLE_CYCLE_TIME (20 ms where unset). Between collectives the ranks compute (--compute_s,
a busy loop). Reports the cycles, and the seconds between cycles at least REST_S apart (the loop resting, or
kept from its core); every collective's sum is checked."""
import json
import os
import pathlib
import time

import tensorflow as tf
from absl import app, flags

import horovod.tensorflow as hvd
import _worker

flags.DEFINE_float("compute_s", 0.25, "Seconds of computing between two collectives.")
flags.DEFINE_integer("steps", 4, "Collectives, each after compute_s of computing.")
FLAGS = flags.FLAGS

#: a gap between two cycles this long or longer counts as rest (a rest lasts up to 20 ms after its cycle began)
REST_S = 0.015


def compute(seconds):
    """Keeps this rank's core busy for `seconds`, as a step's forward and backward pass would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def main(_):
    os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"  # (rank 0 starts it: hvd.start_timeline)
    hvd.init()
    timeline = pathlib.Path(_worker.FLAGS.out_dir) / "timeline.json"
    if hvd.rank() == 0:
        hvd.start_timeline(str(timeline), mark_cycles=True)
    sums = [float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="first").numpy()[0])]
    begin = time.perf_counter()
    for step in range(FLAGS.steps):
        compute(FLAGS.compute_s)
        sums.append(float(hvd.allreduce(tf.constant([float(step)]), op=hvd.Sum, name=f"step{step}").numpy()[0]))
    seconds = time.perf_counter() - begin
    result = dict(sums=sums, seconds=seconds)
    if hvd.rank() == 0:
        hvd.stop_timeline()
        text = timeline.read_text()
        events = json.loads(text if text.rstrip().endswith("]") else text.rstrip().rstrip(",") + "]")
        names = [e.get("args", {}).get("name") or e.get("name") for e in events]
        starts = sorted(e["ts"] / 1e6 for e in events if e.get("name") == "CYCLE_START")
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        result.update(cycles=len(starts), rested_s=sum(g for g in gaps if g >= REST_S),
                      names=sorted(set(map(str, names))))
    _worker.report(hvd, **result)


if __name__ == "__main__":
    app.run(main)
