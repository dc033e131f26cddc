"""What compression adds to a step's computation: step time on one rank with no network, by phase.

    .venv/bin/python benchmarks/overhead.py                                   # both models, every method
    .venv/bin/python benchmarks/overhead.py --models=digits_cnn --methods=sgd,onebit --steps=5

One rank, no horovodrun: Horovod's size is 1 (hvd.init() works without a
launcher), so the collectives move no bytes and what is left is the
computation each method adds, and Horovod's own cost of running a collective
(copies into and out of its buffers, handing the op to its background thread
and back). Per model (benchmarks/wire.py's mlp25m and digits_cnn), a fresh
process (this script, --role=worker) builds the model, and over it an
optimizer per method (wire.benchmarked_optimizer's: hc.methods' names and
wire.py's variants over --optimizer's optimizer, SGD(0.01, momentum 0.9,
Nesterov) or AdamW(1e-3, weight decay 0.01); no_exchange is that optimizer
bare, no Horovod wrapper, the floor), compiles launch.training_step of each on
one random batch of --batch_size, runs each --warmup times, then:
- step ms: the median wall time of --steps steps (step().numpy()), not
  profiled, the methods taking their steps in turn (A B C, A B C, ...); beside
  it, the ms it adds to no_exchange's step: the median over the turns of its
  step less no_exchange's in the same turn. On a shared VM a neighbour's load
  comes and goes within seconds (one process's steps moved from 450 to 360 ms
  within a run of 20), and a step taken beside the floor's pays the same; the
  methods train one model, so their forward and backward passes read the same
  memory (with a model per method, the same matmuls took 196 to 275 ms a step
  in one process). The turns follow --methods' order; the methods share
  Horovod's tensor names in one process (on one rank its negotiation is
  local).
  --nointerleave runs a process per method instead and subtracts the floor's
  median step. With --rounds=R every job runs R times in turn (a fresh
  process each time) and a row is the round of its median addition (its
  median step without interleaving), with the rounds' range;
- phases: --profile_steps more steps under TensorFlow's profiler
  (tf.profiler.experimental, host tracer), whose XSpace
  (tensorflow.tsl.profiler.protobuf.xplane_pb2) has one event per op the
  executor ran, named by the op's node name (name scopes included) and type.
  TF_NUM_INTEROP_THREADS=1 (set for the workers), so ops run one after
  another. Each op is charged its own time and the idle time after it until
  the next op starts (the executor's bookkeeping), except idle time while a
  Horovod collective is outstanding (from its ProcessAsync::Start to its
  ProcessAsync::Done on Horovod's thread), which is charged to the collective.
  An op's phase:
  - collective: Horovod ops (HorovodAllreduce, HorovodAlltoall, ..., and the
    tiny HorovodSize/HorovodRank queries);
  - apply: the optimizer's own scope (the Keras optimizer's name, e.g. SGD/:
    momentum and variable updates) and hvd_compress's hc_state_update scopes
    (residual e = a - D and its assign, worker momentum, the exchange's state,
    direct variable updates; hvd_compress/optimizer.py);
  - encode / decode: the exchange's scope (hvd_compress's hc_exchange: error
    feedback, the dense tensors' grouped allreduce, every bucket's exchange;
    Horovod's DistributedOptimizer's <name>_Allreduce: its fp16 casts).
    encode: the ops that feed a collective (through data inputs, in the
    step's graph) and that no collective feeds: what is done before the first
    collective; decode: the rest, what is done with what the collectives
    return (two-way onebit's server stage between its alltoall and its
    allgather included) and the local decoding of what was sent (for the
    residual). An op the graph does not name (a node Grappler added) counts as
    encode if it started before the step's first collective, decode if not;
  - compute: everything else (forward, loss, backward).
  runtime: the rest of the profiled step (tf.function call and return, the
  executor's start), so the phases and runtime add up to the profiled step.
  Each phase is its median over the profiled steps. The profiler adds a little
  to every op; the profiled step is shown beside the unprofiled one.
On one rank a collective moves no bytes, but Horovod still hands it to its
background thread, which runs collectives once per cycle (HOROVOD_CYCLE_TIME,
1 ms by default): a chain of collectives (onebit's alltoall, then allgather)
waits up to a cycle for each. What Horovod's thread does while the executor
runs other ops (on a second core) is not in the collective column: only the
executor's wait is. Horovod's DistributedOptimizer (horovod_fp32, horovod_fp16)
skips its allreduce, fp16 casts included, where the process set has one rank
(a tf.cond on size > 1: horovod.tensorflow._allreduce_cond); with
--horovod_allreduce_at_size_1 (the default) this script makes it run them, as
on more ranks, so that its rows show what its exchange costs.
Prints one markdown table per model and writes every row (with each phase's
costliest ops) to --out. The figures are one CPU's computation: run it on a
quiet machine (nothing else running), with --threads intra-op threads per
rank (1 by default, as benchmarks/wire.py gives each rank on a 2-core
machine).

Flags shared with benchmarks/wire.py (its module defines them; this one reuses
them, with its own defaults): --methods, --models, --steps, --warmup,
--rounds, --batch_size, --optimizer, --timeout (per method: an interleaved job
of N methods may take N times it), --out, and the worker's --role, --model,
--result (the worker takes --methods too).
"""
import collections
import functools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_keras: the baselines are Horovod's Keras wrappers

from absl import app, flags  # noqa: E402

import launch  # noqa: E402
import results  # noqa: E402
import wire  # noqa: E402

PHASES = ["compute", "encode", "collective", "decode", "apply"]
BASELINE = wire.NO_EXCHANGE  # the bare Keras optimizer: the floor
DEFAULT_METHODS = [BASELINE, *wire.BASELINES, "none", "fp16", "onebit", "quantize8", "quantize4", "topk", "randomk",
                   "sketch", "powersgd"]
COLLECTIVE = re.compile(r"Horovod(Grouped)?(Allreduce|Allgather|Alltoall|Broadcast|Reducescatter)")
EXCHANGE_SCOPE = re.compile(r"(hc_exchange|Distributed\w*_Allreduce)(_\d+)?")
STATE_SCOPE = "hc_state_update"
OP_EVENT = re.compile(r"([^:\s]+):(\w+)")  # a synchronous op: "node/name:Type"
ASYNC_START, ASYNC_DONE = "ExecutorState::ProcessAsync::Start", "ExecutorState::ProcessAsync::Done"

flags.DEFINE_integer("profile_steps", 10, "Profiled steps (after the timed ones) for the phases.", lower_bound=1)
flags.DEFINE_integer("threads", 1, "TF_NUM_INTRAOP_THREADS of the workers (inter-op: always 1).")
flags.DEFINE_integer("top_ops", 5, "The JSON keeps this many costliest ops per phase.")
flags.DEFINE_bool("interleave", True, "Every method of a model in one process, their steps taken in turn; what a "
                  "method adds to the floor is the median of its step less the floor's in the same turn. False: a "
                  "process per method, the floor's median step subtracted.")
flags.DEFINE_bool("horovod_allreduce_at_size_1", True, "Makes Horovod's DistributedOptimizer (horovod_fp32, "
                  "horovod_fp16) run its allreduce and casts on one rank, where it otherwise skips them.")
for name in ("methods", "models", "steps", "warmup", "rounds", "batch_size", "optimizer", "tf_cpu_allocator", "timeout",
             "out"):
    flags.declare_key_flag(name)  # wire.py's, listed in --help
FLAGS = flags.FLAGS
FLAGS.set_default("methods", DEFAULT_METHODS)
FLAGS.set_default("steps", 20)
FLAGS.set_default("out", "results/overhead.json")


# -- worker: one model's methods in this process ---------------------------------------------------
def worker():
    """Builds --model once and an optimizer over it per method of --methods, runs each method's step --warmup
    times, then times --steps turns in which every method takes one step in turn (A B C, A B C, ...), and profiles
    each; writes their rows. A method's added_ms is the median over the turns of its step less the floor's step
    in the same turn (where the floor is among them): a shared machine's drift falls on both alike, and the
    forward and backward passes run on the same weights, in the same memory."""
    import hvd_compress as hc
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    keras = hc.require_legacy_keras()
    hvd.init()
    if FLAGS.horovod_allreduce_at_size_1:
        allreduce_at_size_1(hvd)
    tf.keras.utils.set_random_seed(0)
    model = wire.build_model(keras, FLAGS.model)
    x = tf.random.normal([FLAGS.batch_size, *model.input_shape[1:]])
    y = tf.random.uniform([FLAGS.batch_size], 0, model.output_shape[-1], tf.int64)
    jobs = []
    for method in FLAGS.methods:
        optimizer, _ = wire.benchmarked_optimizer(hc, hvd_keras, keras, method)
        train = launch.training_step(keras, model, optimizer)  # a tf.function: its graph tells encode from decode
        step = functools.partial(train, x, y)
        for _ in range(FLAGS.warmup):
            step().numpy()
        jobs.append(dict(method=method, optimizer=optimizer, train=train, step=step, times=[]))
    for _ in range(FLAGS.steps):
        for job in jobs:
            start = time.perf_counter()
            job["step"]().numpy()
            job["times"].append(1000 * (time.perf_counter() - start))
    floor = next((job for job in jobs if job["method"] == BASELINE), None)
    from hvd_compress import cost
    probe_ms = 1e3 * cost.probe_s()  # this machine's pass over 16M floats, by which cost.py scales these costs
    rows = []
    for job in jobs:
        roles = exchange_roles(job["train"].get_concrete_function(x, y).graph.as_graph_def())
        steps = [attribute(ops, window, collectives, roles, job["optimizer"].name)
                 for ops, window, collectives in step_events(profile(job["step"], FLAGS.profile_steps))]
        median = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731,B023
        added = (statistics.median(t - f for t, f in zip(job["times"], floor["times"]))
                 if floor is not None and job is not floor else None)
        rows.append(dict(
            model=FLAGS.model, method=job["method"], optimizer=FLAGS.optimizer,
            params=int(sum(v.shape.num_elements() for v in model.trainable_variables)),
            step_ms=statistics.median(job["times"]), step_ms_each=job["times"], added_ms=added,
            interleaved=[j["method"] for j in jobs] if len(jobs) > 1 else None,
            phases_ms={p: median(p) for p in PHASES}, runtime_ms=median("runtime"),
            profiled_step_ms=median("step"), top_ops=top_ops(steps, FLAGS.top_ops),
            steps=FLAGS.steps, warmup=FLAGS.warmup, profile_steps=FLAGS.profile_steps,
            batch_size=FLAGS.batch_size, intra_op_threads=FLAGS.threads, probe_ms=probe_ms,
            horovod_allreduce_at_size_1=FLAGS.horovod_allreduce_at_size_1))
    pathlib.Path(FLAGS.result).write_text(json.dumps(rows))


def allreduce_at_size_1(hvd):
    """Makes horovod.tensorflow's DistributedOptimizer allreduce (and cast, for fp16) on one rank too:
    it goes through _allreduce_cond and _grouped_allreduce_cond, a tf.cond on the process set's size
    > 1, which pick the collective as they would on more ranks once replaced by it."""
    hvd._allreduce_cond = lambda tensor, *args, **kwargs: hvd.allreduce(tensor, *args, **kwargs)
    hvd._grouped_allreduce_cond = lambda tensors, *args, **kwargs: hvd.grouped_allreduce(tensors, *args, **kwargs)


def exchange_roles(graph_def):
    """{op name: "encode" or "decode"} for every op of the step's graph and of the functions it calls
    (named as Grappler names them once inlined: <call op>/<op>): encode if it feeds a Horovod
    collective of its graph and no collective feeds it, decode otherwise. Data inputs only
    (tf.function's automatic control dependencies chain stateful ops in program order)."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    roles = {}

    def visit(nodes, prefix):
        inputs = {n.name: [i.split(":")[0] for i in n.input if not i.startswith("^")] for n in nodes}
        consumers = collections.defaultdict(list)
        for name, sources in inputs.items():
            for source in sources:
                consumers[source].append(name)
        collectives = [n.name for n in nodes if COLLECTIVE.fullmatch(n.op)]
        upstream = reachable(collectives, lambda name: inputs.get(name, []))
        downstream = reachable(collectives, lambda name: consumers[name])
        for n in nodes:
            roles[prefix + n.name] = "encode" if n.name in upstream and n.name not in downstream else "decode"
            if n.attr["f"].func.name in functions:  # (Stateful)PartitionedCall
                visit(functions[n.attr["f"].func.name].node_def, f"{prefix}{n.name}/")

    visit(graph_def.node, "")
    return roles


def reachable(names, neighbours):
    """The names reachable from `names` (themselves excluded) through neighbours(name)."""
    seen, todo = set(), list(names)
    while todo:
        for name in neighbours(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def profile(step, count):
    """Runs `count` steps under TensorFlow's profiler (host tracer only); their XSpace."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory(prefix="overhead-") as logdir:
        tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0, device_tracer_level=0))
        try:
            for _ in range(count):
                step().numpy()
        finally:
            tf.profiler.experimental.stop()
        paths = list(pathlib.Path(logdir).rglob("*.xplane.pb"))
        if len(paths) != 1:
            raise RuntimeError(f"expected one .xplane.pb under the profiler's folder, found {paths}")
        space = xplane_pb2.XSpace()
        space.ParseFromString(paths[0].read_bytes())
        return space


Event = collections.namedtuple("Event", "name start end stats")  # times in ms


def host_events(space):
    """Every event of the host plane, all threads, with its stats by name (references resolved)."""
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    stat_names = {k: m.name for k, m in plane.stat_metadata.items()}

    def value(stat):
        kind = stat.WhichOneof("value")
        return stat_names[stat.ref_value] if kind == "ref_value" else getattr(stat, kind)

    for line in plane.lines:
        for e in line.events:
            start = line.timestamp_ns / 1e6 + e.offset_ps / 1e9
            yield Event(plane.event_metadata[e.metadata_id].name, start, start + e.duration_ps / 1e9,
                        {stat_names[s.metadata_id]: value(s) for s in e.stats})


def step_events(space):
    """Per profiled step: (ops, window, collectives). ops: (name, type, start, end) sorted by start,
    an asynchronous op (Horovod's collectives) by its start; window: the tf.function call's
    (start, end); collectives: (start, end) from each asynchronous op's start to its completion."""
    events = list(host_events(space))
    windows = sorted((e.start, e.end) for e in events if "tf_function_call" in e.stats)
    done = {(e.stats.get("name"), e.stats.get("step_id")): e.end for e in events if e.name == ASYNC_DONE}
    ops, collectives = [], []
    for e in events:
        if e.name == ASYNC_START:
            ops.append((e.stats["name"], e.stats["kernel_type"], e.start, e.end))
            collectives.append((e.start, done.get((e.stats["name"], e.stats.get("step_id")), e.end)))
        elif OP_EVENT.fullmatch(e.name):
            ops.append((*e.name.split(":"), e.start, e.end))
    ops.sort(key=lambda op: op[2])
    for start, end in windows:
        yield ([op for op in ops if start <= op[2] < end], (start, end),
               [c for c in collectives if start <= c[0] < end])


def overlap(start, end, intervals):
    """How much of [start, end) the union of `intervals` covers."""
    covered, reach = 0.0, start
    for s, e in sorted(intervals):
        s, e = max(s, reach), min(e, end)
        if e > s:
            covered += e - s
            reach = e
    return covered


def phase_of(name, kind, start, first_collective, roles, apply_scope):
    if kind.startswith("Horovod"):
        return "collective"
    scopes = name.split("/")[:-1]
    if any(scope.startswith(STATE_SCOPE) or re.fullmatch(rf"{re.escape(apply_scope)}(_\d+)?", scope)
           for scope in scopes):
        return "apply"
    if any(EXCHANGE_SCOPE.fullmatch(scope) for scope in scopes):
        return roles.get(name) or ("encode" if start < first_collective else "decode")  # Grappler's: by time
    return "compute"


def attribute(ops, window, collectives, roles, apply_scope):
    """One profiled step's ms per phase, "runtime" (the window outside the ops), "step" (the window),
    and "ops": ms per (phase, op name)."""
    first_collective = min((c[0] for c in collectives), default=window[1])
    ms = dict.fromkeys(PHASES, 0.0)
    per_op = collections.Counter()
    for i, (name, kind, start, end) in enumerate(ops):
        following = ops[i + 1][2] if i + 1 < len(ops) else window[1]
        end = min(end, following)
        idle_waiting = overlap(end, following, collectives)
        phase = phase_of(name, kind, start, first_collective, roles, apply_scope)
        own = following - start - idle_waiting
        ms[phase] += own
        ms["collective"] += idle_waiting
        per_op[phase, name] += own
        per_op["collective", "(waiting for Horovod)"] += idle_waiting
    runtime = (window[1] - window[0]) - sum(ms.values())
    return dict(ms, runtime=runtime, step=window[1] - window[0], ops=per_op)


def top_ops(steps, count):
    """Per phase, its `count` costliest ops (mean ms per profiled step)."""
    total = sum((s["ops"] for s in steps), collections.Counter())
    return {p: [(name, ms / len(steps)) for (phase, name), ms in total.most_common() if phase == p][:count]
            for p in PHASES}


# -- launcher: a worker per model and method ---------------------------------------------------------
def run_job(model, methods):
    """Runs one worker (a fresh process: nothing left over from another job) for the methods (interleaved where
    several); their rows."""
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        result = pathlib.Path(tmp) / "row.json"
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--role=worker", f"--model={model}",
                f"--methods={','.join(methods)}", f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}",
                f"--profile_steps={FLAGS.profile_steps}", f"--batch_size={FLAGS.batch_size}",
                f"--threads={FLAGS.threads}", f"--top_ops={FLAGS.top_ops}", f"--result={result}",
                f"--optimizer={FLAGS.optimizer}",
                f"--horovod_allreduce_at_size_1={str(FLAGS.horovod_allreduce_at_size_1).lower()}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}  # one rank, not a launcher's
        env.update(TF_NUM_INTRAOP_THREADS=str(FLAGS.threads), TF_NUM_INTEROP_THREADS="1", OMP_NUM_THREADS="1",
                   TF_CPP_MIN_LOG_LEVEL="2", **launch.allocator_env(FLAGS.tf_cpu_allocator))
        done = subprocess.run(argv, env=env, timeout=FLAGS.timeout * len(methods), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True)
        if done.returncode:
            tail = "\n".join(done.stdout.splitlines()[-30:])
            raise RuntimeError(f"{model} {','.join(methods)}: the worker exited with {done.returncode}:\n{tail}")
        return [dict(row, tf_cpu_allocator=FLAGS.tf_cpu_allocator) for row in json.loads(result.read_text())]


def median_round(rounds):
    """One method's row over its rounds: where its steps were paired with the floor's (interleaved), the round of
    its median added_ms, with every round's in added_ms_rounds; otherwise the round of its median step
    (wire.median_round). Either way every round's step is in step_ms_rounds."""
    if rounds[0].get("added_ms") is None:
        return wire.median_round(rounds)
    middle = statistics.median_low([r["added_ms"] for r in rounds])
    row = next(r for r in rounds if r["added_ms"] == middle)
    return dict(row, step_ms_rounds=[r["step_ms"] for r in rounds], added_ms_rounds=[r["added_ms"] for r in rounds])


def added_cell(row, baseline):
    """What a row adds to the floor's step (ms): the median of its paired differences where it was interleaved
    with the floor (with the rounds' range), else its step less the floor's row's."""
    if row.get("added_ms") is not None:
        rounds = row.get("added_ms_rounds") or []
        spread = f" ({min(rounds):+.0f} to {max(rounds):+.0f})" if len(rounds) > 1 else ""
        return f"{row['added_ms']:+.1f}{spread}"
    return f"{row['step_ms'] - baseline['step_ms']:+.1f}" if baseline and row is not baseline else "-"


def baseline_of(rows):
    """The floor's row: no_exchange ("sgd", the bare SGD, in files from before --optimizer), or None."""
    return next((r for r in rows if r["method"] in (BASELINE, "sgd")), None)


def print_table(model, rows):
    baseline = baseline_of(rows)
    print(f"\n### {model} ({rows[0]['params']:,} parameters, batch {FLAGS.batch_size}, "
          f"{wire.OPTIMIZERS[FLAGS.optimizer]})\n")
    print(f"| method | step ms | added to {BASELINE}, ms | " + " | ".join(PHASES) + " | runtime | profiled step |")
    print("|---|---:|---:|" + "---:|" * (len(PHASES) + 2))
    for r in rows:
        print(f"| {r['method']} | {wire.step_cell(r)} | {added_cell(r, baseline)} | "
              + " | ".join(f"{r['phases_ms'][p]:.2f}" for p in PHASES)
              + f" | {r['runtime_ms']:.2f} | {r['profiled_step_ms']:.1f} |")


def main(_):
    if FLAGS.role == "worker":
        return worker()
    launch.check_names("overhead.py", "methods", FLAGS.methods, wire.METHODS)
    launch.check_names("overhead.py", "models", FLAGS.models, wire.MODELS)
    print(f"One rank, no network (Horovod size 1). Per method: the median of {FLAGS.steps} steps after "
          f"{FLAGS.warmup} warmup, then {FLAGS.profile_steps} profiled steps for the phases (ms, each the median "
          f"over them), {FLAGS.threads} intra-op and 1 inter-op TensorFlow thread. These are CPU timings: "
          f"the machine should be quiet (nothing else running).", flush=True)
    runs = {}  # (model, method) -> its rounds' rows; a round runs every job once, in turn
    jobs = [FLAGS.methods] if FLAGS.interleave else [[method] for method in FLAGS.methods]
    for round_ in range(FLAGS.rounds):
        for model in FLAGS.models:
            for methods in jobs:
                for r in run_job(model, methods):
                    runs.setdefault((model, r["method"]), []).append(r)
                    which = f" (round {round_ + 1} of {FLAGS.rounds})" if FLAGS.rounds > 1 else ""
                    added = f" ({r['added_ms']:+.1f} paired)" if r.get("added_ms") is not None else ""
                    print(f"{model} {r['method']}{which}: step {r['step_ms']:.1f} ms{added}; " + ", ".join(
                        f"{p} {r['phases_ms'][p]:.2f}" for p in PHASES) + f" ms (profiled step "
                          f"{r['profiled_step_ms']:.1f} ms)", flush=True)
    rows = [median_round(rounds) for rounds in runs.values()]
    for model in FLAGS.models:
        print_table(model, [r for r in rows if r["model"] == model])
    print(f"\nstep ms: unprofiled median. added to {BASELINE}: ms added to the step of the bare "
          f"{wire.OPTIMIZERS[FLAGS.optimizer]} (no wrapper): "
          + ("the median of the method's step less the floor's in the same turn (interleaved). "
             if FLAGS.interleave and BASELINE in FLAGS.methods else "the step less the floor's. ")
          + "Phases (profiled): compute = forward + backward; encode = the exchange's ops that feed a collective "
          "(error feedback, compression, casts); collective = Horovod's ops and the wait for them (on one rank: "
          "its own overhead, copies and cycle); decode = the exchange's ops after them; apply = the optimizer's "
          "updates and hvd_compress's residual / momentum / state assigns; runtime = the tf.function call "
          "outside the ops. horovod_fp32 / horovod_fp16 (Horovod's DistributedOptimizer) "
          + ("run their allreduce here, which Horovod skips on one rank. " if FLAGS.horovod_allreduce_at_size_1
             else "skip their allreduce on one rank, as Horovod does. ")
          + "See the docstring of benchmarks/overhead.py.")
    command = launch.command_line(__file__, models=FLAGS.models, methods=FLAGS.methods, steps=FLAGS.steps,
                                  warmup=FLAGS.warmup, rounds=FLAGS.rounds, profile_steps=FLAGS.profile_steps,
                                  batch_size=FLAGS.batch_size, optimizer=FLAGS.optimizer, threads=FLAGS.threads,
                                  horovod_allreduce_at_size_1=FLAGS.horovod_allreduce_at_size_1,
                                  tf_cpu_allocator=FLAGS.tf_cpu_allocator, interleave=FLAGS.interleave,
                                  out=FLAGS.out)
    print(f"\nReproduce with:\n    {command}")
    results.save(FLAGS.out, rows)
    publish(rows)


def render(rows):
    """One model's rows as docs/benchmarks.md shows them: the unprofiled step, what it adds to the floor's
    (no_exchange: the bare optimizer), and the profiled phases (ms)."""
    baseline = baseline_of(rows)
    r0 = rows[0]
    paired = any(r.get("added_ms") is not None for r in rows)  # (interleaved beside the floor)
    optimizer = r0.get("optimizer", "sgd")
    probes = [r["probe_ms"] for r in rows if r.get("probe_ms")]  # (tables of runs before the probe: none)
    note = (f"{r0['model']}, {r0['params']:,} parameters, batch {r0['batch_size']}, every method on Keras's "
            f"{wire.OPTIMIZERS[optimizer]}"
            + (" (hvd_compress's compressing from the first timed step)" if optimizer == "adamw" else "")
            + ", one rank (no network), "
            f"{r0['intra_op_threads']} intra-op and 1 inter-op thread, {launch.allocator_note(r0)}; step: median of "
            f"{r0['steps']} steps after {r0['warmup']}"
            + ("; every method in one process, their steps taken in turn, and what a method adds to "
               f"{BASELINE} the median of its step less {BASELINE}'s in the same turn" if paired else "")
            + (f"; the round of the median {'addition' if paired else 'step'} of "
               f"{len(r0['step_ms_rounds'])}, every method once a round, with the rounds' range"
               if len(r0.get("step_ms_rounds") or []) > 1 else "")
            + f"; phases: that round's medians over {r0['profile_steps']} profiled steps; ms"
            + (f"; the cost model's probe (a pass over 16M floats, hvd_compress.cost.probe_s) here "
               f"{statistics.median(probes):.1f} ms" if probes else "") + ".")
    table = results.markdown_table(
        ["method", "step", f"added to {baseline['method'] if baseline else BASELINE}", *PHASES],
        [[r["method"], wire.step_cell(r), added_cell(r, baseline),
          *(f"{r['phases_ms'][p]:.1f}" for p in PHASES)] for r in rows])
    return f"{note}\n\n{table}"


def publish(rows):
    """The table of each model in docs/benchmarks.md: overhead_<model> (overhead_<model>_adamw over AdamW)."""
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        results.publish(f"overhead_{model}{launch.table_suffix(mine[0])}", render(mine), results.command_line(),
                        source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
