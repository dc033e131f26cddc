"""Step time and bytes per step on a real shaped link: N ranks, each in its own network namespace.

    sudo .venv/bin/python benchmarks/wire.py                         # 100mbit,1gbit,10gbit x 2,4 ranks
    .venv/bin/python benchmarks/wire.py --rates=100mbit --ranks=2 --models=mlp25m --methods=horovod_fp32,horovod_fp16,onebit
    .venv/bin/python benchmarks/wire.py --hosts=2x2 --rates=1gbit,10gbit --models=mlp25m   # 2 hosts of 2 ranks

Needs root (it exits with status 2 and says why otherwise). For every rate and
layout it builds netns.Network(layout, rate): with --ranks=N, N hosts of one
rank (rank i runs in namespace hc-wire-<i> as host hc-ns<i>: local_size 1,
cross_size N); with --hosts=HxL (or a+b, see netns.parse_layout), H hosts of L
ranks, the ranks of a host in one namespace, talking to each other over its
loopback and sharing its one link (local_size L, cross_size H). Each host's
only link is a veth to a bridge in the root namespace, shaped to the rate in
both directions (see netns.py). No horovodrun: this launcher starts Horovod's own
RendezvousServer (bound to all addresses; the ranks reach it at the bridge's
10.77.0.1), gives each rank the HOROVOD_* variables that horovodrun's Gloo
launcher would (horovod.runner.gloo_run.create_run_env_vars and
create_slot_env_vars), and runs `ip netns exec hc-wire-<i> unshare --uts --
python wire.py --role=worker ...` with a hard timeout per job. With
--launcher=mpi one mpirun starts the ranks instead, with a remote shell that
enters each host's namespace where ssh would log into it
(launch.run_in_namespaces): Horovod's collectives then run over Open MPI, and
SGP can send point to point (sgp_mpi, sgp_overlap_mpi); the tables of such a
run are published apart (wire_<model>_mpi). The ranks run with TensorFlow's BFC allocator
(TF_CPU_ALLOCATOR_USE_BFC=1; launch.TF_CPU_ALLOCATORS says why), their tables apart (_bfc);
--tf_cpu_allocator=default gives them TensorFlow's default CPU allocator.

Each worker trains `--warmup` steps, then, between two tiny allreduce
barriers, `--steps` timed steps, and reads its host's interface's kernel counters
(/sys/class/net/hcw-eth/statistics, visible to it inside its namespace)
around them (a host's link is counted once, by its local rank 0); then it idles `--idle_s` seconds, when only Horovod's own control
traffic crosses the link (its background loop negotiates every cycle, whether or
not there are tensors: at stock Horovod's 1 ms cycle ~300 kB/s per rank here, ~110
kB/s of it TCP payload; this project's Horovod rests between the cycles of a quiet
loop, up to HOROVOD_IDLE_CYCLE_TIME, 20 ms). Per model, N and method the table shows:
- step ms: the median step (forward, backward, exchange, update) of the slowest rank (local-step methods, which
  sync every H steps: the mean step over --steps rounded up to whole periods, each ending on a sync); with
  --rounds=R, every method runs R times in turn (round 1 runs each once, then round 2...) and the
  row is the round of the median step (the lower middle one for an even R), the rounds' range
  beside it: a machine whose speed drifts over minutes (measured here: the same step 259-371 ms
  within an hour) then slows every method alike instead of the one running at the time;
- step vs Horovod fp32, step vs Horovod fp16: their step / this step, measured in the
  same run ("x faster"); Horovod's fp16 is what a user would otherwise pick;
- step vs floor + link: this step / (no_exchange's step in the same run + the time this row's
  host link tx bytes take at the link's rate): how far the method is from its compute plus its
  own bytes on the wire (1.00x: nothing but those);
- accounted bytes/step: what one worker sends per step by the exchange's own
  accounting (hvd_compress's wrappers: opt.bytes_per_step, for DiLoCo a sync's bytes over the inner steps
  between syncs; hier_ methods: what it sends to other hosts, opt.compression_exchange.cross_host_bytes;
  Horovod's fp32 / fp16 and our fp32 (none): the ring
  allreduce, 2 (n-1)/n of the 4- / 2-byte payload);
- host link tx bytes/step: what left a host's veth (mean over hosts; with one rank per
  host, the rank's own), Ethernet, IP and TCP headers included; every host's in the
  row's per_host_tx_bytes;
- wire vs accounted (hosts of one rank; with several, part of a rank's bytes stay on
  its host): the TCP payload in those bytes (veth tx bytes minus
  14 + 20 + 20 + 12 (TCP timestamps) = 66 B per packet sent) / accounted - 1.
  What it adds to the accounting is Horovod's control traffic (per row:
  control_payload_per_step_est and control_vs_accounted_est, the idle rate
  times the step time; the loop does not negotiate while it runs a
  collective, but each collective adds its own negotiation), the barriers,
  and TCP retransmissions (retrans_per_step). Measured: within 2% for
  payloads of megabytes (mlp4m, mlp25m); for the 20k-parameter CNN, whose
  compressed payloads are a few kB per step, Horovod's negotiation adds as
  much again (+10% to +50%). Protocol overhead: the veths keep MTU 1500 and their
  segmentation offloads, so a packet here is up to 64 KiB and the raw counter
  carries few headers (raw_vs_accounted); on a real MTU-1500 wire every
  1448-byte segment carries 66 B of headers (+4.6%), plus the ACKs for what
  the rank receives (66 B per one or two segments: +2.3% to +4.6%), about +7%
  in all. The shaping charges that: tbf counts every segment's headers, so
  100mbit carries at most 95.6 Mbit/s of payload.
- host link bytes vs Horovod fp32: Horovod fp32's host link tx bytes per step (same run, link,
  layout and model) over the row's; on hosts of several ranks this counts what hierarchical
  exchanges save inside the host, which the accounted bytes of one rank do not show.
Every rank's JSON (a row's per_rank) also holds its CPU time per step (cpu_ms: its threads' user and kernel
time, the sends through the shaped veth included) and the machine's idle core time per step (idle_cores_ms):
where the ranks share the machine's cores, what a method costs a rank in CPU is step time whether or not its
collectives could have overlapped. --fusion_threshold_bytes sets hvd_compress's bucket size for its methods.
Prints one markdown table per rate, the command that reproduces it, and
writes every row (per-rank figures included) to --out.

Methods (make_optimizer): hvd_compress's registry, hc.methods (its names and
defaults, through hc.methods.distributed_optimizer): horovod_fp32 and
horovod_fp16 are Horovod's own horovod.tensorflow.keras.DistributedOptimizer;
none (Horovod's fp32 allreduce in hc.DistributedOptimizer, whose wrapped SGD
updates in fused kernels, as in every hc row), fp16 (hvd_compress's own 16-bit
exchange), onebit (two-way), onebit_oneway, quantize8, quantize4, topk,
randomk, sketch (ratio 4), fetchsgd (ratio 4) and powersgd are
hc.DistributedOptimizer; sgp is hc.PushSumOptimizer. This benchmark's own
(VARIANTS, ACCORDION): sgp_overlap, sgp_mpi and sgp_overlap_mpi are SGP
overlapping the next step, over MPI's point-to-point transport, and both
(launch.GOSSIP_VARIANTS; the _mpi ones need --launcher=mpi); topk_4x (top-k at the sketches' bytes on 2 ranks, 1/8
of the coordinates); onebit_oneway_b256 (onebit one-way with a scale per 256
elements); quantize2 (2-bit quantization); accordion_critical and accordion_calm are Accordion's
PowerSGD rank 4 <-> 1 with every layer in the critical (rank 4) or the calm
(rank 1) regime, the regime detector's accumulation included. hier_<name> (HIERARCHICAL): <name> with
hierarchical=True, averaged inside each host and compressed across hosts; hier_none is Horovod's
hierarchical fp32 allreduce done by hvd_compress (Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE needs its NCCL
build and does nothing on CPUs). Models: mlp25m (25.2M parameters, communication-bound),
mlp4m (4.2M, for the test), digits_cnn (examples/digits.py's CNN, 20k), text24m (time_to_accuracy.py
--task=text's model, 24.2M), transformer (its default task's causal transformer, examples/transformer.py), all
on random batches of --batch_size per rank (sequences of character codes for the last two).
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
from hvd_compress import methods as registry  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
#: this benchmark's methods beyond hc.methods' names: name -> (a name of hc.methods, its overrides)
VARIANTS = {
    # Top-k at the sketches' bytes on 2 ranks: 1/8 of the coordinates, values and indices, is d/4 floats.
    "topk_4x": ("topk", dict(ratio=1 / 8)),
    # 1-bit Adam's setting that kept AdamW's accuracy on the transformer (2 ranks): one-way, a scale per 256 elements.
    "onebit_oneway_b256": ("onebit", dict(two_way=False, block_size=256)),
    # 2-bit blockwise quantization: under AdamW, Adam with its variance frozen after the warm-up and the gradient in
    # 2 bits, error-fed (1/14 of fp32's bytes, twice 1-bit Adam's)
    "quantize2": ("quantize8", dict(bits=2)),
    # SGP overlapping the next step, and either sending point to point (--launcher=mpi)
    **launch.GOSSIP_VARIANTS,
    # DiLoCo and SparseLoCo on runs of a few hundred steps: more syncs, or a plain average (outer rate 1, no momentum)
    "diloco_h5": ("diloco", dict(sync_every=5)),
    "diloco_average": ("diloco", dict(outer_learning_rate=1.0, outer_momentum=0.0)),
    "diloco_average_h5": ("diloco", dict(sync_every=5, outer_learning_rate=1.0, outer_momentum=0.0)),
    "sparseloco_h5": ("sparseloco", dict(sync_every=5)),
    "sparseloco_h5_10pct": ("sparseloco", dict(sync_every=5, compression=registry.compression("topk", ratio=0.1))),
    # the average every 5 steps taken 1.4x as far (outer rate 1.4, no momentum), in full precision or in 4 bits; in 4
    # bits 1.7x
    "diloco_h5_lr14": ("diloco", dict(sync_every=5, outer_learning_rate=1.4, outer_momentum=0.0)),
    "diloco_q4_h5_lr14": ("diloco_q4", dict(sync_every=5, outer_learning_rate=1.4, outer_momentum=0.0)),
    "diloco_q4_h5_lr17": ("diloco_q4", dict(sync_every=5, outer_learning_rate=1.7, outer_momentum=0.0)),
    # the plain average (outer rate 1, no momentum) in 4 bits, whole or streamed: 160x fewer bytes than fp32
    "diloco_average_q4": ("diloco_q4", dict(outer_learning_rate=1.0, outer_momentum=0.0)),
    "streaming_average_q4": ("streaming_diloco", dict(outer_learning_rate=1.0, outer_momentum=0.0)),
    # Streaming DiLoCo at full precision, each fragment's exchange in the background for 4 of the 5 steps between
    # fragments: what the overlap hides where a sync is long
    "streaming_diloco_fp32": ("streaming_diloco", dict(sync_delay=4, compression=registry.compression("none"))),
}
#: Accordion's PowerSGD rank 4 <-> 1 with every layer critical (rank 4) or calm (rank 1)
ACCORDION = ("accordion_critical", "accordion_calm")
#: Compression.auto(): it calibrates for its first AUTO_CALIBRATION steps, then warms its choice's step up and times it
AUTO, AUTO_CALIBRATION = "auto", 10
BASELINES = ("horovod_fp32", "horovod_fp16")
#: Each rank steps its own model and sends nothing: the step's compute alone, the floor that an exchange hidden
#: behind it approaches.
NO_EXCHANGE = "no_exchange"
#: hc.DistributedOptimizer(hierarchical=True): hier_<name> is hc.methods' <name> averaged inside each host and
#: compressed across hosts; hier_none is Horovod's hierarchical fp32 allreduce (the algorithm of its NCCL build,
#: which its CPU build lacks: HOROVOD_HIERARCHICAL_ALLREDUCE does nothing there)
HIERARCHICAL = {f"hier_{name}": name for name in ("none", "fp16", "onebit", "onebit_oneway", "quantize8", "quantize4",
                                                  "topk", "randomk", "powersgd")}
#: --optimizer: the optimizer every method wraps (and no_exchange steps alone), by name
OPTIMIZERS = {"sgd": "SGD(0.01, momentum=0.9, nesterov=True)", "adamw": "AdamW(1e-3, weight_decay=0.01)"}
# make_optimizer's methods, Horovod's own first:
METHODS = [*BASELINES, *(name for name in registry.NAMES if name not in BASELINES), *VARIANTS, *ACCORDION,
           *HIERARCHICAL, AUTO, NO_EXCHANGE]
MLPS = {"mlp25m": [1000, 3500, 3500, 2700, 10],  # 25,236,710 parameters
        "mlp4m": [512, 2048, 1536, 10]}  # 4,213,258 parameters
#: text24m: time_to_accuracy.py --task=text's model (launch.text_mlp, 24.2M parameters, an embedding first);
#: transformer: its default task's (examples/transformer.py's causal transformer, 0.4M parameters, compute-bound)
MODELS = [*MLPS, "digits_cnn", "text24m", "transformer"]

flags.DEFINE_enum("role", "launcher", ["launcher", "worker"], "launcher builds the network and starts the ranks.")
flags.DEFINE_list("rates", ["100mbit", "1gbit", "10gbit"], "Link rates (tc syntax), one table each.")
flags.DEFINE_list("ranks", ["2", "4"], "Numbers of ranks, each a host of its own (--hosts replaces it).")
flags.DEFINE_list("hosts", [], "Host layouts, e.g. 2x2 (2 hosts of 2 ranks sharing each host's link) or 3+2 "
                  "(netns.parse_layout); when given, instead of --ranks.")
flags.DEFINE_list("methods", [m for m in METHODS if not launch.needs_mpi(m)], f"Methods, of {METHODS}.")
flags.DEFINE_list("models", ["mlp25m", "digits_cnn"], f"Models, of {MODELS}.")
flags.DEFINE_integer("steps", 10, "Timed steps.")
flags.DEFINE_integer("warmup", 3, "Untimed steps before them (the first one traces).")
flags.DEFINE_integer("rounds", 1, "Times every job runs, in turn: a row is the round of its median step (see the "
                     "module's docstring); odd counts have a middle round.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Batch per rank.")
flags.DEFINE_enum("optimizer", "sgd", list(OPTIMIZERS), "The optimizer every method wraps: "
                  + "; ".join(f"{name}: Keras's {made}" for name, made in OPTIMIZERS.items())
                  + ". Under adamw hvd_compress's methods compress from the first timed step (warmup_steps=--warmup): "
                  "1-bit Adam, and Adam with its variance frozen after the warm-up under the others.")
flags.DEFINE_bool("slow_start_after_idle", True, "Linux's default; false sets "
                  "net.ipv4.tcp_slow_start_after_idle=0 in the ranks' namespaces (see netns.py).")
flags.DEFINE_float("idle_s", 1.0, "Seconds without steps after the timed ones, to measure Horovod's "
                   "own control traffic.")
flags.DEFINE_integer("inter_op_threads", 1, "TensorFlow inter-op threads per rank; 2 lets the last layers' exchange "
                     "start during the backward pass (docs/architecture.md, \"Buckets and overlap\").", lower_bound=1)
flags.DEFINE_enum("tf_cpu_allocator", "bfc", launch.TF_CPU_ALLOCATORS, "TensorFlow's CPU allocator in the "
                  "ranks: bfc (TF_CPU_ALLOCATOR_USE_BFC=1) reuses tensors' memory, where the default takes a large "
                  "tensor's memory afresh from the kernel each time (launch.TF_CPU_ALLOCATORS); tables made with "
                  "bfc are published apart (_bfc) from older ones made with the default.")
flags.DEFINE_integer("fusion_threshold_bytes", None, "hvd_compress's bucket size (DistributedOptimizer's "
                     "fusion_threshold_bytes) for its compressed methods; unset: the wrapper's default.")
flags.DEFINE_integer("timeout", 600, "Seconds one job (one model, N, method on one rate) may take before "
                     "its ranks are killed.")
flags.DEFINE_enum("launcher", "gloo", launch.LAUNCHERS, "How the ranks start: gloo (Horovod's collectives over "
                  "Gloo) or mpi (mpirun: Horovod's over MPI; the _mpi methods need it). Tables of an MPI launch are "
                  "published apart (<table>_mpi).")
flags.DEFINE_string("out", "results/wire.json", "launcher: the rows' JSON.")
flags.DEFINE_string("table_suffix", "", "Appended to the published tables' names, for a run whose tables stand beside "
                    "another run's of the same models and settings (e.g. _local_steps).")
flags.DEFINE_string("method", None, "worker: the method.")
flags.DEFINE_string("model", None, "worker: the model.")
flags.DEFINE_string("result", None, "worker: where this rank writes its JSON.")
FLAGS = flags.FLAGS


def is_local_steps(method):
    """Whether `method` (of METHODS) is DiLoCo's, hc.methods.LOCAL_STEP_METHODS or a variant of one."""
    return VARIANTS.get(method, (method,))[0] in registry.LOCAL_STEP_METHODS


def make_optimizer(hc, hvd, keras, method, base_optimizer, **wrapper_kwargs):
    """(optimizer, accounted): the optimizer for `method`, and accounted(num_params), the bytes one
    worker sends per step by the exchange's own accounting (call it after the first step: hc's
    exchanges are built then). wrapper_kwargs: the wrapper's own arguments (e.g. warmup_steps).

    hvd is horovod.tensorflow.keras. A method is hc.methods' (its name and defaults), a VARIANTS
    entry (a name of hc.methods with other arguments) or one of ACCORDION.
    """
    from hvd_compress.exchange import allreduce_bytes

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")

    def ring(bytes_per_element):  # Horovod's own allreduce of every gradient
        return lambda opt, params: allreduce_bytes(bytes_per_element * params, hvd.size())

    accounting = {
        "horovod_fp32": ring(4), "horovod_fp16": ring(2),
        # Horovod's fp32 allreduce through hvd_compress's wrapper: its only difference from horovod_fp32 is
        # the wrapped SGD's update in TensorFlow's fused kernels (keras_compat.fused_sgd_update), as every
        # hc row has. (fp16, hvd_compress's own 16-bit exchange, counts its own: fused F16C casts, each
        # shard summed in float32 by its owner.)
        "none": ring(4),
        # hierarchical: what crosses to other hosts (the rest stays on the host's loopback)
        **{name: (lambda opt, params: opt.compression_exchange.cross_host_bytes) for name in HIERARCHICAL},
    }.get(VARIANTS.get(method, (method,))[0], lambda opt, params: opt.bytes_per_step)  # (local steps: per period)
    if method == NO_EXCHANGE:
        return base_optimizer, lambda num_params: 0.0
    if method == AUTO:
        optimizer = hc.DistributedOptimizer(base_optimizer, compression=hc.Compression.auto(
            calibration_steps=AUTO_CALIBRATION), **wrapper_kwargs)
    elif method in ACCORDION:  # PowerSGD rank 4 (critical) <-> rank 1 (calm), as callbacks.Accordion sets it up
        optimizer = hc.DistributedOptimizer(base_optimizer, **wrapper_kwargs)
        optimizer.compression_exchange.use_accordion(
            hc.accordion.AdaptiveCompression(hc.methods.compression("powersgd", rank=4),
                                             hc.methods.compression("powersgd", rank=1)),
            hc.accordion.RegimeDetector())
    elif method in HIERARCHICAL:
        optimizer = launch.optimizer(hc, HIERARCHICAL[method], base_optimizer, hierarchical=True, **wrapper_kwargs)
    else:
        optimizer = launch.optimizer(hc, method, base_optimizer, VARIANTS, **wrapper_kwargs)
    return optimizer, lambda num_params: float(accounting(optimizer, num_params))


def build_model(keras, name):
    sys.path.insert(0, str(REPO / "examples"))
    if name == "digits_cnn":
        import digits
        return digits.cnn(keras)
    if name in ("text24m", "transformer"):
        from pydoc_text import character_codes
        if name == "transformer":
            import transformer
            return transformer.transformer(keras, character_codes()[1])
        return launch.text_mlp(keras, character_codes()[1])
    return launch.mlp(keras, MLPS[name])


def interface_counters(iface):
    """This namespace's kernel counters for iface, and TCP's retransmitted segments."""
    stats = pathlib.Path("/sys/class/net") / iface / "statistics"
    counters = {k: int((stats / k).read_text()) for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")}
    tcp = [line.split() for line in pathlib.Path("/proc/net/snmp").read_text().splitlines()
           if line.startswith("Tcp:")]
    counters["retrans"] = int(tcp[1][tcp[0].index("RetransSegs")])
    return counters


def idle_cpu_s():
    """Seconds every core of this machine has been idle since boot (/proc/stat's idle and iowait)."""
    fields = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def header_bytes():
    """Bytes of headers per TCP packet in this namespace: Ethernet 14, IPv4 20, TCP 20, timestamps 12."""
    timestamps = pathlib.Path("/proc/sys/net/ipv4/tcp_timestamps").read_text().strip() != "0"
    return 14 + 20 + 20 + (12 if timestamps else 0)


def base_optimizer(keras):
    """--optimizer's optimizer, as OPTIMIZERS names it."""
    if FLAGS.optimizer == "adamw":
        return keras.optimizers.AdamW(1e-3, weight_decay=0.01)
    return keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)


def benchmarked_optimizer(hc, hvd_keras, keras, method):
    """make_optimizer(method) over --optimizer's optimizer. Under AdamW hvd_compress's own wrappers warm up for
    the untimed steps (--warmup), so that every timed step is compressed (1-bit Adam needs a warm-up; the
    error-feedback methods then freeze Adam's variance, the setting measured best under AdamW)."""
    ours = (method not in (*BASELINES, NO_EXCHANGE) and not method.startswith("sgp")
            and not is_local_steps(method))
    wrapper = dict(warmup_steps=FLAGS.warmup) if FLAGS.optimizer == "adamw" and ours else {}
    if FLAGS.fusion_threshold_bytes is not None and ours:
        wrapper["fusion_threshold_bytes"] = FLAGS.fusion_threshold_bytes
    return make_optimizer(hc, hvd_keras, keras, method, base_optimizer(keras), **wrapper)


def worker():
    import hvd_compress as hc
    import tensorflow as tf
    from hvd_compress.exchange import allreduce_bytes
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    keras = hc.require_legacy_keras()
    hvd.init(process_sets="dynamic")  # (the hier_ methods make the hosts' process sets)
    tf.keras.utils.set_random_seed(0)
    model = build_model(keras, FLAGS.model)
    opt, accounted = benchmarked_optimizer(hc, hvd_keras, keras, FLAGS.method)
    # (auto: no untimed warm-up; the first of its calibration's steps traces and is not timed)
    step = launch.warm_step(keras, model, opt, FLAGS.batch_size, warmup=0 if FLAGS.method == AUTO else FLAGS.warmup)
    choice = why = None  # Compression.auto()'s, and its reason (rank 0's)
    if FLAGS.method == AUTO:  # its calibration as model.fit's callbacks run it, then its choice's step, retraced
        auto, decided = opt.hc_auto, False  # (once it has decided, the optimizer's compression is its choice)
        while not decided:
            _, decided = auto.train_step(opt, model.trainable_variables, lambda: step().numpy())
        choice, why = auto.decision, auto.reason
        step = launch.warm_step(keras, model, opt, FLAGS.batch_size, warmup=FLAGS.warmup)
    if FLAGS.method == "accordion_calm":  # every layer calm, so at high compression (no retrace)
        critical = opt.compression_exchange.monitor.critical
        critical.assign(tf.zeros_like(critical))
        step().numpy()
    iface = netns.IFACE
    # SGP with overlap, Streaming DiLoCo: the last steps' messages or exchanges are still in flight after them;
    # counted in the window that sends them (PushSum.flush and OuterStep.settle wait for them), not the next one's
    settle = (getattr(getattr(opt, "pushsum", None), "flush", None) or getattr(getattr(opt, "diloco", None),
                                                                                "settle", None) or (lambda: None))
    steps = timed_steps(opt, step)

    settle()
    hvd.allreduce(tf.zeros([1]), name="wire.before").numpy()
    before, times, cpu_before, idle_before = interface_counters(iface), [], os.times(), idle_cpu_s()
    for _ in range(steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    settle()
    hvd.allreduce(tf.zeros([1]), name="wire.after").numpy()
    after, cpu_after, idle_after = interface_counters(iface), os.times(), idle_cpu_s()
    start = time.perf_counter()  # no collective now: what crosses the link is Horovod's own
    time.sleep(FLAGS.idle_s)
    idle, idle_s = interface_counters(iface), time.perf_counter() - start
    hvd.allreduce(tf.zeros([1]), name="wire.idle").numpy()

    params = int(sum(v.shape.num_elements() for v in model.trainable_variables))
    pathlib.Path(FLAGS.result.format(rank=hvd.rank())).write_text(json.dumps(dict(
        rank=hvd.rank(), size=hvd.size(), hostname=socket.gethostname(), params=params,
        local_rank=hvd.local_rank(), local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
        cross_size=hvd.cross_size(),
        inter_op_threads=int(os.environ["TF_NUM_INTEROP_THREADS"]), choice=choice, choice_why=why,
        step_ms=1000 * (statistics.fmean(times) if hasattr(opt, "diloco") else statistics.median(times)),
        step_times_ms=[1000 * t for t in times], accounted=accounted(params),
        # CPU time of this rank's threads per step, user and kernel (the barriers' and the sends' included)
        idle_cores_ms=1000 * (idle_after - idle_before) / steps,  # the whole machine's, every rank's view
        cpu_ms=1000 * sum(getattr(cpu_after, k) - getattr(cpu_before, k) for k in ("user", "system")) / steps,
        fp32_allreduce=allreduce_bytes(4 * params, hvd.size()), header_bytes=header_bytes(),
        control={k: (idle[k] - after[k]) / idle_s for k in idle},  # per second
        **{k: (after[k] - before[k]) / steps for k in after})))


def timed_steps(opt, step):
    """--steps, or for a local-step method (DiLoCo) whole sync periods: it steps on, untimed, to just after a sync,
    and times the next --steps rounded up to a multiple of its period, so that the mean step (its row's step) and
    the link counters hold the syncs in their share."""
    diloco = getattr(opt, "diloco", None)
    if diloco is None:
        return FLAGS.steps
    while int(diloco.inner_steps.numpy()) % diloco.sync_every:
        step().numpy()
    return -(-FLAGS.steps // diloco.sync_every) * diloco.sync_every


# -- launcher -------------------------------------------------------------------------------------
def run_job(net, model, method):
    """Runs one job on net's ranks; returns the ranks' JSON, ordered by rank."""
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--role=worker", f"--model={model}",
            f"--method={method}", f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}",
            f"--batch_size={FLAGS.batch_size}", f"--idle_s={FLAGS.idle_s}", f"--optimizer={FLAGS.optimizer}",
            *([f"--fusion_threshold_bytes={FLAGS.fusion_threshold_bytes}"]
              if FLAGS.fusion_threshold_bytes is not None else [])]
    return launch.run_in_namespaces(net, argv, FLAGS.timeout, f"{model} {method} on {net.layout} ranks",
                                    inter_op_threads=FLAGS.inter_op_threads, launcher=FLAGS.launcher,
                                    tf_cpu_allocator=FLAGS.tf_cpu_allocator, point_to_point=launch.needs_mpi(method))


def summarize(rate, layout, model, method, ranks):
    """One table row from the ranks' figures; the link counters are the hosts' (local rank 0's)."""
    hosts = [r for r in ranks if r["local_rank"] == 0]
    host_mean = lambda key: statistics.fmean(r[key] for r in hosts)  # noqa: E731
    payload = [r["tx_bytes"] - r["header_bytes"] * r["tx_packets"] for r in hosts]
    # Horovod's control traffic in a step, estimated as its idle rate times the step time: the
    # background loop does not negotiate while it runs a collective (less), but each collective
    # adds its own negotiation (more).
    control = [(r["control"]["tx_bytes"] - r["header_bytes"] * r["control"]["tx_packets"])
               * r["step_ms"] / 1000 for r in hosts]
    accounted = statistics.fmean(r["accounted"] for r in ranks)
    one_rank_hosts = len(hosts) == len(ranks)  # else part of a rank's bytes stay on its host
    return dict(
        rate=rate, layout=layout, model=model, ranks=len(ranks), hosts=len(hosts), method=method, launcher=FLAGS.launcher,
        choice=ranks[0].get("choice"),  # Compression.auto()'s
        params=ranks[0]["params"], step_ms=max(r["step_ms"] for r in ranks), accounted=accounted,
        fp32_allreduce=statistics.fmean(r["fp32_allreduce"] for r in ranks),
        veth_tx_bytes=host_mean("tx_bytes"), veth_tx_packets=host_mean("tx_packets"),
        veth_rx_bytes=host_mean("rx_bytes"), per_host_tx_bytes=[r["tx_bytes"] for r in hosts],
        tcp_payload=statistics.fmean(payload), retrans_per_step=host_mean("retrans"),
        control_tx_bytes_per_s=statistics.fmean(r["control"]["tx_bytes"] for r in hosts),
        control_payload_per_step_est=statistics.fmean(control),
        # (none where nothing is accounted: no_exchange)
        raw_vs_accounted=host_mean("tx_bytes") / accounted - 1 if one_rank_hosts and accounted else None,
        wire_vs_accounted=statistics.fmean(payload) / accounted - 1 if one_rank_hosts and accounted else None,
        control_vs_accounted_est=statistics.fmean(control) / accounted if accounted else None,
        steps=FLAGS.steps, warmup=FLAGS.warmup, batch_size=FLAGS.batch_size, optimizer=FLAGS.optimizer,
        step_ms_rounds=None,
        slow_start_after_idle=FLAGS.slow_start_after_idle, inter_op_threads=FLAGS.inter_op_threads,
        tf_cpu_allocator=FLAGS.tf_cpu_allocator, fusion_threshold_bytes=FLAGS.fusion_threshold_bytes, per_rank=ranks,
        tcp_progress_thread=FLAGS.launcher == "mpi" and launch.needs_mpi(method))


def layouts():
    """The host layouts to run: --hosts, else a host of one rank per rank for each of --ranks. Exits with
    the reason on a layout netns.parse_layout does not read."""
    try:
        return [netns.layout_name(netns.parse_layout(h)) for h in FLAGS.hosts] or [f"{n}x1" for n in FLAGS.ranks]
    except ValueError as e:
        sys.exit(f"{pathlib.Path(sys.argv[0]).name}: --hosts: {e}")


def command_line():
    layout = dict(hosts=FLAGS.hosts) if FLAGS.hosts else dict(ranks=FLAGS.ranks)
    return launch.command_line(__file__, rates=FLAGS.rates, **layout, models=FLAGS.models,
                               methods=FLAGS.methods, steps=FLAGS.steps, warmup=FLAGS.warmup, rounds=FLAGS.rounds,
                               batch_size=FLAGS.batch_size, idle_s=FLAGS.idle_s, optimizer=FLAGS.optimizer,
                               inter_op_threads=FLAGS.inter_op_threads,
                               slow_start_after_idle=FLAGS.slow_start_after_idle, launcher=FLAGS.launcher,
                               tf_cpu_allocator=FLAGS.tf_cpu_allocator,
                               **({"fusion_threshold_bytes": FLAGS.fusion_threshold_bytes}
                                  if FLAGS.fusion_threshold_bytes is not None else {}),
                               **({"table_suffix": FLAGS.table_suffix} if FLAGS.table_suffix else {}),
                               timeout=FLAGS.timeout, out=FLAGS.out)


def main(_):
    if FLAGS.role == "worker":
        return worker()
    launch.check_names("wire.py", "methods", FLAGS.methods, METHODS)
    launch.check_names("wire.py", "models", FLAGS.models, MODELS)
    launch.check_launcher("wire.py", FLAGS.methods, FLAGS.launcher)
    network_layouts = layouts()
    launch.prepare_network_run("wire.py", FLAGS.rates)
    quiet = launch.load_before()
    rows = []
    for rate in FLAGS.rates:
        for layout in network_layouts:
            with netns.Network(layout, rate, FLAGS.slow_start_after_idle) as net:
                runs = {}  # (model, method) -> its row of each round
                for round_ in range(FLAGS.rounds):
                    for model in FLAGS.models:
                        for method in FLAGS.methods:
                            r = summarize(rate, net.layout, model, method, run_job(net, model, method))
                            runs.setdefault((model, method), []).append(r)
                            wire = ("" if r["wire_vs_accounted"] is None else
                                    f" (TCP payload {r['wire_vs_accounted']:+.2%} vs accounted)")
                            control = ("" if r["control_vs_accounted_est"] is None else
                                       f", would be {r['control_vs_accounted_est']:+.2%} over a step")
                            which = f" (round {round_ + 1} of {FLAGS.rounds})" if FLAGS.rounds > 1 else ""
                            print(f"{rate} {net.layout} {model} {method}{which}: step {r['step_ms']:.1f} ms, accounted "
                                  f"{r['accounted']:,.0f} B, host link tx {r['veth_tx_bytes']:,.0f} B{wire}; "
                                  f"Horovod's idle control traffic, {r['control_tx_bytes_per_s'] / 1e3:.0f} kB/s"
                                  f"{control}", flush=True)
                rows += [median_round(rounds) for rounds in runs.values()]
    for rate in FLAGS.rates:
        print(f"\n### {rate}\n")
        print(render([r for r in rows if r["rate"] == rate]))
    params = sorted({(r["model"], r["params"]) for r in rows})
    print(f"\nParameters: {', '.join(f'{model} {count:,}' for model, count in params)}. "
          f"Batch {FLAGS.batch_size} per rank, {FLAGS.steps} timed steps after {FLAGS.warmup}, "
          f"{os.cpu_count()} CPU cores shared by the ranks, {FLAGS.inter_op_threads} TensorFlow inter-op "
          f"thread(s) per rank, TCP slow start after idle "
          f"{'on (Linux default)' if FLAGS.slow_start_after_idle else 'off'}; {quiet}.")
    print(f"\nReproduce with:\n    {command_line()}")
    results.save(FLAGS.out, rows)
    publish(rows)


def median_round(rounds):
    """One job's row over its rounds: the round of the median step (statistics.median_low: a round that ran, whose
    bytes go with its step), with every round's step in step_ms_rounds."""
    middle = statistics.median_low([r["step_ms"] for r in rounds])
    row = next(r for r in rounds if r["step_ms"] == middle)
    return dict(row, step_ms_rounds=[r["step_ms"] for r in rounds])


def method_label(row):
    """A row's method as the tables name it: Compression.auto()'s with its choice, "auto (onebit)"."""
    return f"{row['method']} ({row['choice']})" if row.get("choice") else row["method"]


def step_cell(row):
    """A row's step ms, with its rounds' range where it ran several."""
    rounds = row.get("step_ms_rounds") or []
    spread = f" ({min(rounds):.0f}-{max(rounds):.0f})" if len(rounds) > 1 else ""
    return f"{row['step_ms']:.1f}{spread}"


def layout_of(row):
    """A row's host layout ("2x1" in files from before layouts: one rank per host)."""
    return row.get("layout") or f"{row['ranks']}x1"


def render(rows):
    """Rows as docs/benchmarks.md shows them: every link, layout and model, ratios to Horovod's fp32 and fp16
    taken in the same run (same link, model and layout)."""
    # Horovod's own optimizers: horovod_fp32 / horovod_fp16; fp32 / fp16 in files from before hc.methods' names
    # (which called ours hc_fp32 / hc_fp16)
    old = bool({r["method"] for r in rows} & {"fp32", "hc_fp32", "hc_fp16"})
    horovod = {p: p if old else f"horovod_{p}" for p in ("fp32", "fp16")}

    def versus(r, method, field="step_ms"):
        """`method`'s r[field] in the same link, layout and model over r's (how many times r is faster or smaller)."""
        key = lambda x: (x["rate"], layout_of(x), x["model"], x["method"])  # noqa: E731
        base = next((x for x in rows if key(x) == (*key(r)[:3], method)), None)
        return results.times(base[field] / r[field]) if base and base.get(field) and r.get(field) else "-"

    def versus_floor(r):
        """r's step / (no_exchange's step + r's host link bytes at the link's rate)."""
        key = lambda x: (x["rate"], layout_of(x), x["model"])  # noqa: E731
        floor = next((x for x in rows if key(x) == key(r) and x["method"] == NO_EXCHANGE), None)
        if floor is None or r["method"] == NO_EXCHANGE or not r.get("veth_tx_bytes"):
            return "-"
        link_ms = r["veth_tx_bytes"] * 8 / netns.rate_bits(r["rate"]) * 1e3
        return f"{r['step_ms'] / (floor['step_ms'] + link_ms):.2f}x"

    r0 = rows[0]
    allocator = launch.allocator_note(r0)
    models = ", ".join(dict.fromkeys(f"{r['model']} ({r['params']:,} parameters)" for r in rows))
    optimizer = r0.get("optimizer", "sgd")
    note = (f"{models}, batch {r0['batch_size']} per rank, every method on Keras's {OPTIMIZERS[optimizer]}"
            + (" (hvd_compress's compressing from the first timed step)" if optimizer == "adamw" else "")
            + f"; median step of the slowest "
            f"rank over {r0['steps']} steps after {r0['warmup']}"
            + ("; local-step methods (DiLoCo): the mean step over whole sync periods, the --steps rounded up to them"
               if any(is_local_steps(r["method"]) for r in rows) else "")
            + (f", the round of the median step of {len(r0['step_ms_rounds'])}, every job once a round, with the rounds' "
               f"range" if len(r0.get("step_ms_rounds") or []) > 1 else "")
            + f"; {r0['inter_op_threads']} TensorFlow inter-op thread(s) "
            f"per rank; TCP slow start after idle {'on' if r0['slow_start_after_idle'] else 'off'}; "
            f"{launch.launched(r0.get('launcher', 'gloo'))}; {allocator}. Hosts: HxL is H "
            f"hosts of L ranks sharing the host's link; bytes on a host's link are its veth's kernel counter, per step."
            + (f" {NO_EXCHANGE}: each rank steps alone and sends nothing (the step's compute alone)."
               if any(r["method"] == NO_EXCHANGE for r in rows) else "")
            + (" The jobs that send point to point ran with Open MPI's TCP progress thread (btl_tcp_progress_thread=1), "
               "the others without (launch.MPI_POINT_TO_POINT_MCA)." if any(r.get("tcp_progress_thread") for r in rows)
               else ""))
    table = results.markdown_table(
        ["link", "hosts", "model", "method", "step ms", "step vs Horovod fp32", "step vs Horovod fp16",
         "step vs floor + link", "accounted bytes/step/worker", "host link tx bytes/step", "wire vs accounted",
         "host link bytes vs Horovod fp32"],
        [[r["rate"], layout_of(r), r["model"], method_label(r),
          step_cell(r), versus(r, horovod["fp32"]),
          versus(r, horovod["fp16"]), versus_floor(r), results.count(r["accounted"]), results.count(r["veth_tx_bytes"]),
          "-" if r.get("wire_vs_accounted") is None else f"{r['wire_vs_accounted']:+.2%}",
          versus(r, horovod["fp32"], "veth_tx_bytes") if r["accounted"] else "-"] for r in rows],
        align=["l", "l", "l", "l"] + ["r"] * 8)
    return f"{note}\n\n{table}"


def publish(rows):
    """The table of each model in docs/benchmarks.md: wire_<model>, or wire_<model>_hosts where hosts run
    several ranks."""
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        several = any(r.get("hosts", r["ranks"]) < r["ranks"] for r in mine)
        name = f"wire_{model}_hosts" if several else f"wire_{model}"
        results.publish(name + launch.table_suffix(mine[0]) + FLAGS.table_suffix, render(mine), results.command_line(),
                        source=FLAGS.out)


if __name__ == "__main__":
    app.run(results.run(main, publish))
