"""Whether compression pays for a job, before running it: predicted step, bytes and accuracy risk per method.

    python -m hvd_compress.advise --parameters=125m --compute_ms=180 --ranks=16 --hosts=2 --link=10gbit --optimizer=adamw
    python -m hvd_compress.advise --model=model.keras --compute_ms=350 --ranks=2 --link=1gbit

`advise(...)` (and this command) predicts every method's step with the cost model (hvd_compress/cost.py: the step's
compute, the method's own passes on this kind of machine, its planned bytes on the host's link and the collectives'
latency), beside Horovod's fp32 and fp16 allreduce, and says which to use: the fastest method whose measured accuracy
risk under the optimizer is low, or Horovod's own allreduce where no compression is faster by more than the model's
own error (`MARGIN`).

Accuracy risk (`ACCURACY`): the points of test accuracy each method lost against full precision in this project's
own runs: under SGD the digits CNN (2 ranks, 16 epochs), under AdamW the causal transformer (3 seeds, 2 ranks) and
the 24M text model (2 ranks, one epoch). low: within half a point; medium: within 2; high: more; unmeasured.
"""
import dataclasses
import math

from hvd_compress import cost

#: (points against full precision, where measured) per optimizer and method
ACCURACY = {
    "sgd": {m: (points, "digits CNN, 2 ranks, 16 epochs") for m, points in dict(
        none=0.0, fp16=0.0, onebit=+0.28, onebit_oneway=-0.28, quantize8=0.0, quantize4=0.0, topk=+0.28,
        randomk=0.0, powersgd=+0.83, sketch=+0.55, fetchsgd=-0.28, horovod_fp32=0.0, horovod_fp16=0.0).items()},
    "adamw": {
        **{m: (0.0, "full precision") for m in ("none", "horovod_fp32", "horovod_fp16")},
        "fp16": (0.0, "16-bit allreduce, as Horovod fp16"),
        "onebit": (-0.29, "1-bit Adam one-way, a scale per 256 (its Adam defaults): causal transformer, 3 seeds"),
        "topk": (-4.15, "top-k 1%: causal transformer, 3 seeds"),
        "powersgd": (-3.34, "PowerSGD rank 4: causal transformer, 3 seeds"),
        "randomk": (-22.72, "random-k 10%: causal transformer, 3 seeds"),
        "diloco": (-6.36, "H=20, outer Nesterov: 24M text model, 2 ranks, one epoch"),
        "sparseloco": (-11.02, "H=20, top-k 1%: 24M text model, 2 ranks, one epoch"),
        "diloco_q4": (-3.38, "H=20, 4 bits, plain average: 24M text model, 2 ranks, two epochs"),
        "streaming_diloco": (-2.98, "4 fragments, 4 bits, plain average: 24M text model, 2 ranks, two epochs"),
    },
}
#: a compressed method is recommended over Horovod's allreduce only where its predicted step is this much shorter:
#: the cost model's error on the published shaped-link rows (benchmarks/cost_check.py)
MARGIN = 0.15
BASELINES = ("horovod_fp32", "horovod_fp16")
DEFAULT_METHODS = (*BASELINES, "fp16", "onebit", "quantize8", "quantize4", "topk", "powersgd", "diloco_q4",
                   "streaming_diloco")


def risk(points):
    if points is None:
        return "unmeasured"
    return "low" if points >= -0.5 else "medium" if points >= -2.0 else "high"


@dataclasses.dataclass(frozen=True)
class Advice:
    """One method's predicted step (cost.Step), its accuracy risk and where that was measured."""
    step: cost.Step
    points: float
    measured_on: str

    @property
    def risk(self):
        return risk(self.points)


def shapes_of(model):
    """A Keras model's trainable tensors' shapes, stand-ins for a parameter count (cost.model_shapes), or a list of
    shapes as it is."""
    if isinstance(model, list) and all(isinstance(s, tuple) for s in model):
        return model
    if isinstance(model, (int, float)):
        if model < 1:
            raise ValueError(f"parameters={model}: a model has at least one parameter.")
        return cost.model_shapes(int(model))
    variables = getattr(model, "trainable_variables", None)
    if variables is None:
        raise TypeError(f"model={model!r}: give a Keras model or a parameter count.")
    return [tuple(int(d) for d in v.shape) for v in variables]


def advise(model, compute_s, cluster, optimizer="sgd", machine=None, methods=DEFAULT_METHODS, hierarchical=None):
    """Every method's Advice for `model` (a Keras model, a parameter count or a list of shapes) whose step takes `compute_s` seconds with
    nothing sent, on `cluster` (cost.Cluster) under `optimizer` ("sgd" or "adamw"), fastest first. machine: the
    cost.Machine of the ranks (default: the published CPU figures under the optimizer). hierarchical: compress only
    across hosts (default: where hosts hold several ranks)."""
    if compute_s <= 0:
        raise ValueError(f"compute_s={compute_s}: the step's compute with nothing sent must be positive (time a step "
                         "on one rank, or benchmarks/overhead.py's no_exchange row).")
    shapes = shapes_of(model)
    machine = machine or cost.published_cpu(optimizer)
    hierarchical = cluster.local_size > 1 if hierarchical is None else hierarchical
    accuracy = ACCURACY[optimizer]
    advice = []
    for method in methods:
        step = cost.predict(method, shapes, compute_s, cluster, machine, optimizer, hierarchical=hierarchical)
        points, where = accuracy.get(method, (None, "not measured under this optimizer"))
        advice.append(Advice(step, points, where))
    return sorted(advice, key=lambda a: a.step.total_s)


def recommend(advice):
    """The Advice to follow: the fastest of low risk, where it beats the faster of Horovod's fp32 and fp16 by more
    than MARGIN; else that Horovod allreduce."""
    baseline = min((a for a in advice if a.step.method in BASELINES), key=lambda a: a.step.total_s)
    safe = [a for a in advice if a.risk == "low" and a.step.method not in BASELINES]
    best = min(safe, key=lambda a: a.step.total_s, default=None)
    if best is not None and best.step.total_s < (1 - MARGIN) * baseline.step.total_s:
        return best
    return baseline


def render(advice):
    """The advice as a markdown table."""
    uncompressed = next(a.step for a in advice if a.step.method == "horovod_fp32") if any(
        a.step.method == "horovod_fp32" for a in advice) else None
    lines = ["| method | predicted step ms | compute | own | link | bytes/step/rank | on a host's link | vs Horovod fp32 "
             "| accuracy risk | measured on |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for a in advice:
        s = a.step
        speedup = f"{uncompressed.total_s / s.total_s:.2f}x" if uncompressed else "-"
        points = "" if a.points is None else f" ({a.points:+.2f})"
        lines.append(f"| {s.method} | {s.total_s * 1e3:,.1f} | {s.compute_s * 1e3:,.1f} | {s.own_s * 1e3:,.1f} | "
                     f"{s.link_s * 1e3:,.1f} | {s.bytes_per_rank:,.0f} | {s.host_link_bytes:,.0f} | {speedup} | "
                     f"{a.risk}{points} | {a.measured_on} |")
    return "\n".join(lines)


def parse_count(text):
    """'125m', '7b', '24223708' -> a parameter count."""
    text = str(text).strip().lower()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise ValueError(f"--parameters={text!r}: give a count such as 24223708, 125m or 7b.") from None


def main(argv):
    from absl import app, flags
    FLAGS = flags.FLAGS
    del argv
    if bool(FLAGS.parameters) == bool(FLAGS.model):
        raise app.UsageError("give one of --parameters (a count, e.g. 125m) or --model (a .keras file).")
    if FLAGS.model:
        import keras
        model = keras.models.load_model(FLAGS.model, compile=False)
    else:
        model = parse_count(FLAGS.parameters)
    cluster = cost.Cluster(FLAGS.ranks, cost.Link.parse(FLAGS.link, FLAGS.latency_us * 1e-6), FLAGS.hosts or None,
                           intra_host_rate=cost.Link.parse(FLAGS.intra_host_link).rate_bps,
                           transport=FLAGS.transport or ("nccl" if FLAGS.machine == "h100" else "gloo"),
                           sync_s=FLAGS.sync_ms / 1e3)
    machine = (cost.H100 if FLAGS.machine == "h100" else cost.published_cpu(FLAGS.optimizer) if FLAGS.machine == "cpu"
               else cost.published_cpu(FLAGS.optimizer).scaled_by_probe(cost.probe_s()))
    advice = advise(model, FLAGS.compute_ms / 1e3, cluster, FLAGS.optimizer, machine, FLAGS.methods)
    chosen = recommend(advice)
    elements = sum(math.prod(s) for s in shapes_of(model))
    print(f"{elements:,} parameters, {cluster.ranks} ranks on {cluster.hosts} hosts, {FLAGS.link} per host, "
          f"{FLAGS.optimizer}, compute {FLAGS.compute_ms:g} ms a step; own costs: {machine.name}.\n")
    print(render(advice))
    print(f"\nRecommended: {chosen.step.method} ({chosen.step.total_s * 1e3:,.1f} ms a step, accuracy risk "
          f"{chosen.risk}).")


def define_flags():
    from absl import flags
    flags.DEFINE_string("parameters", None, "The model's parameter count (e.g. 24223708, 125m, 7b).")
    flags.DEFINE_string("model", None, "A Keras model file (.keras) whose trainable variables are planned.")
    flags.DEFINE_float("compute_ms", None, "The step's compute with nothing sent, ms (a step timed on one rank, or "
                       "benchmarks/overhead.py's no_exchange row).")
    flags.DEFINE_integer("ranks", 2, "Ranks in all.", lower_bound=1)
    flags.DEFINE_integer("hosts", 0, "Hosts (0: one rank per host).", lower_bound=0)
    flags.DEFINE_string("link", "1gbit", "Each host's link rate: 100mbit, 1gbit, 10gbit, 400gbit...")
    flags.DEFINE_float("latency_us", 50.0, "The link's latency per message round, microseconds.")
    flags.DEFINE_float("sync_ms", 0.0, "What a step that exchanges pays once, whatever it sends: its ranks' meeting "
                       "(a step at full precision less its compute, its bytes' time on the link and Horovod's "
                       "hand-over), ms.", lower_bound=0.0)
    flags.DEFINE_string("intra_host_link", "100gbit", "The rate between the ranks of one host (NVLink: 3600gbit).")
    flags.DEFINE_enum("transport", None, list(cost.TRANSPORTS), "Whose collectives Horovod runs (default: gloo on "
                      "CPUs, nccl with --machine=h100); on CPUs Gloo adds float16 in software, which Horovod fp16 pays.")
    flags.DEFINE_enum("optimizer", "sgd", sorted(ACCURACY), "The wrapped optimizer (Adam and its kinds: adamw).")
    flags.DEFINE_enum("machine", "cpu", ["cpu", "this_cpu", "h100"], "The methods' own costs: the published CPU "
                      "tables; the same scaled to this machine by the time of a pass over 16M floats (cost.probe_s, "
                      "on the threads TensorFlow gives this process); or an H100's kernels.")
    flags.DEFINE_list("methods", list(DEFAULT_METHODS), "Methods to compare (names of hc.methods).")
    flags.mark_flag_as_required("compute_ms")


if __name__ == "__main__":
    from absl import app
    define_flags()
    app.run(main)
