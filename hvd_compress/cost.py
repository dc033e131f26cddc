"""What a training step costs under each method, from measured parts: the model behind `hvd_compress.advise`.

    step = compute + own + link
    own  = per_element[method] * d + per_collective * collectives          (the method's own work on one rank)
    link = host_link_bytes * 8 / rate + collectives * rounds * latency     (an alpha-beta model of the collectives)
           + syncs * sync                                                  (the ranks meeting once a step)

- compute: the step with nothing sent (`no_exchange`: forward, backward and the wrapped optimizer's own apply),
  measured by the user (`benchmarks/overhead.py`'s floor, or a step timed on one rank) or, for the GPU tables,
  6 N tokens FLOPs at an assumed utilisation (`transformer_compute_s`).
- own: what the method adds to that on one rank, where nothing crosses a link: its encode, decode, error feedback and
  apply (under Adam, 1-bit Adam's and the frozen-variance rules replace Keras's apply, so it can be negative), and
  Horovod's hand-over of each collective to its background thread (half its 1 ms cycle on average). `Machine`
  holds the per-element costs; `published_cpu(optimizer)` is the published one-rank tables' (docs/benchmarks.md,
  "What compression costs"), `H100` the GPU kernels' timings, and `Machine.from_steps` takes one-rank step times
  measured on the user's own machine (`benchmarks/overhead.py`).
- bytes: the exchanges' own accounting, planned the way `hc.DistributedOptimizer` plans them (the same layout,
  buckets and payloads: `planned_bytes`); Horovod's fp32 / fp16 rows the ring allreduce of 4 / 2 bytes an element;
  DiLoCo's a sync's bytes over its H inner steps.
- host link: in a ring (Horovod's allreduce and allgather over Gloo and MPI, NCCL's rings) the ring leaves and
  enters each host once, so a host's link carries what one rank sends; with `hierarchical=True` only the compressed
  exchange among hosts crosses it, and the full-precision stages inside the host move 2 (L-1)/L x 4d bytes at the
  host's own rate (`Cluster.intra_host_rate`, or the CPU ranks' loopback where slower).
- the CPU's share of the collectives (`HostCollectives`, by `Cluster.transport`): a flat ring through hosts of
  several ranks runs at its slowest hop, the host's link or the ranks' loopback; Horovod fp16 over Gloo takes half
  its link's time (the ring's allgather) plus the longer of the other half (its reduce-scatter) and its float16
  sums, which Gloo does in software.
- latency: each collective of a ring takes 2 (n-1) message rounds (allreduce) at `Link.latency_s` each.
- sync: what a step that exchanges pays once, whatever it sends and in how many collectives (`Cluster.sync_s`):
  its ranks wait for the slowest of them and Horovod negotiates the step's collectives in one cycle. A step of
  local-step methods (DiLoCo) pays it at its syncs only, once in H steps (Streaming DiLoCo once a fragment). It
  is a property of the job on its machines, 0 unless measured: on the shared 2-core machines of this project,
  Horovod fp32's step on the 21.5k-parameter CNN took its floor plus 5-7 ms on a 1 or 10 Gbit/s link, its bytes
  0.7 ms of it at 1 Gbit/s. It is not the hand-over in `own`, which each collective pays (half a cycle) on top.

Nothing else overlaps in this model: on the measured machines Horovod's fp32 step on the 25M-parameter models is
about its floor plus its link time, because the CPU that backprops is also the one that moves the bytes (wire.py's
tables, 0.79-1.05x: below 1 where, on 2 cores, one rank's wait on the link leaves the other both cores). Where the
model is wrong it is wrong in one place, a measured term: `benchmarks/cost_check.py` puts its predictions beside
every published shaped-link row.
"""
import dataclasses
import functools
import math
from typing import Optional

#: Horovod's background cycle (HOROVOD_CYCLE_TIME, 1 ms): a collective waits half of it on average
PER_COLLECTIVE_S = 0.5e-3


@dataclasses.dataclass(frozen=True)
class Link:
    """A host's link: rate in bits per second each way, latency in seconds per message round."""
    rate_bps: float
    latency_s: float = 50e-6

    @classmethod
    def parse(cls, text, latency_s=50e-6):
        """'100mbit', '1gbit', '10gbit', '25g', '400gbit' (or bits per second as a number)."""
        value = str(text).strip().lower().removesuffix("bit").removesuffix("ps").removesuffix("b")
        scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(value[-1:], None)
        try:
            rate = float(value[:-1]) * scale if scale else float(value)
        except ValueError:
            raise ValueError(f"link rate {text!r}: give a rate such as '100mbit', '1gbit' or '10gbit'.") from None
        if rate <= 0:
            raise ValueError(f"link rate {text!r}: the rate must be positive.")
        return cls(rate, latency_s)


TRANSPORTS = ("gloo", "mpi", "nccl")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`ranks` ranks on `hosts` hosts (ranks per host = ranks / hosts), each host with one `link` to the others;
    the ranks of a host reach each other at `intra_host_rate` bits per second (NVLink, shared memory, loopback)."""
    ranks: int
    link: Link
    hosts: Optional[int] = None  # None: one rank per host
    intra_host_rate: float = 100e9
    #: whose collectives Horovod runs: "gloo" or "mpi" (on the CPU, where Machine.host_collectives costs the CPU
    #: its share), "nccl" (on the GPU)
    transport: str = "gloo"
    #: seconds a step that exchanges pays once, whatever it sends: the ranks' meeting (see the module's docstring)
    sync_s: float = 0.0

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: Horovod's collectives run over one of {TRANSPORTS} "
                             "(horovodrun --gloo, --mpi; NCCL on GPUs).")
        hosts = self.ranks if self.hosts is None else self.hosts
        if self.ranks < 1 or hosts < 1 or self.ranks % hosts:
            raise ValueError(f"ranks={self.ranks}, hosts={self.hosts}: hosts must divide ranks (each host the same "
                             "number of ranks).")
        if not self.sync_s >= 0:
            raise ValueError(f"sync_s={self.sync_s}: the seconds a step's ranks take to meet are 0 or more.")
        object.__setattr__(self, "hosts", hosts)

    @property
    def local_size(self):
        return self.ranks // self.hosts


@dataclasses.dataclass(frozen=True)
class HostCollectives:
    """What Horovod's collectives over one transport cost the CPU of a rank (benchmarks/host_collectives.py).
    half_sum_per_element_s: the seconds a rank takes to add one float16 element in an allreduce (Gloo adds float16
    in software, an element at a time; Open MPI's sum is Horovod's own, vectorised). A ring allreduce is a
    reduce-scatter, in which a rank adds (n - 1) / n of the vector, one segment while the next crosses the link,
    then an allgather of the sums, which adds nothing: a float16 allreduce takes half its link's time plus the
    longer of the other half and its sums. loopback_rate_bps: the rate at which the ranks of one host move bytes between each
    other (TCP over loopback: copies, by the cores the ranks train on), which bounds a ring's hops inside a host
    and a hierarchical exchange's stages there."""
    half_sum_per_element_s: float
    loopback_rate_bps: float
    #: the probe's pass (`probe_s`) where these were measured, every rank at once: `on_machine`
    probe_s: float

    def on_machine(self, probe_s):
        """These costs on a machine whose probe's pass (every rank at once) takes `probe_s` seconds."""
        factor = probe_s / self.probe_s
        return HostCollectives(self.half_sum_per_element_s * factor, self.loopback_rate_bps / factor, probe_s)


#: Horovod's collectives between the 2 ranks of one host, by transport, with the probe's pass there (both ranks at
#: once): benchmarks/host_collectives.py on a 2-core AMD EPYC (Zen 4), docs/cost_model.md. Open MPI's float16
#: allreduce took no longer than float32's of the same bytes: no float16 sum is charged to it.
HOST_COLLECTIVES = dict(gloo=HostCollectives(21.6e-9, 6.9e9, 30.6e-3), mpi=HostCollectives(0.0, 13.5e9, 34.1e-3))


#: methods that make the same passes over the model as another, measured one (their payloads differ, not their work)
SAME_PASSES = dict(onebit_oneway="onebit", quantize4="quantize8", randomk="topk", fetchsgd="sketch",
                   fp16="none")


@dataclasses.dataclass(frozen=True)
class Machine:
    """Per-element seconds each method adds to a step on one rank (`per_element`, by method name; a method missing
    costs nothing beyond its collectives' hand-over), and that hand-over per collective. `name` says where the figures
    come from."""
    name: str
    per_element: dict
    per_collective_s: float = PER_COLLECTIVE_S
    #: the calibration run's floor (no_exchange's step) per element, where known: `scaled_to` a faster or slower machine
    floor_per_element_s: Optional[float] = None
    #: the calibration machine's time for the probe's pass (`probe_s`), where known: `scaled_by_probe`
    probe_s: Optional[float] = None
    #: what Horovod's collectives cost this machine's CPU, by transport (Cluster.transport; none where not given)
    host_collectives: dict = dataclasses.field(default_factory=dict)

    def scaled_to(self, compute_s, elements):
        """These costs on a machine whose floor is `compute_s` for `elements` elements of the calibration's model (the
        25M MLP): scaled by the floors' ratio (the method's passes and the step's compute are both memory- and
        core-bound on the CPU); itself where the calibration's floor is unknown. Right for that model only: a model
        of more compute per parameter (a transformer, a CNN) has a longer floor per element on the same machine,
        which scaled_by_probe does not confuse with a slower machine (benchmarks/cost_check.py scales every
        table's rows by its floor, and names that miss). The collectives' CPU costs (host_collectives) stay as they
        are: a floor mixes the machine with the model, and those depend on the machine alone."""
        if not self.floor_per_element_s:
            return self
        return self._scaled(compute_s / elements / self.floor_per_element_s, "its floor")

    def scaled_by_probe(self, probe_s):
        """These costs on a machine whose probe's pass (`probe_s()`, with the threads the job trains with, its ranks
        running at once) takes `probe_s` seconds: scaled by the probes' ratio, whatever the model; itself where the
        calibration's probe is unknown."""
        if not self.probe_s:
            return self
        return self._scaled(probe_s / self.probe_s, "the probe",
                            host_collectives={t: c.on_machine(probe_s) for t, c in self.host_collectives.items()})

    def _scaled(self, factor, by, **calibration):
        """Every per-element cost, and the calibration it is known by (floor, probe), times `factor`."""
        calibration = dict(floor_per_element_s=self.floor_per_element_s and self.floor_per_element_s * factor,
                           probe_s=self.probe_s and self.probe_s * factor, **calibration)
        return dataclasses.replace(self, name=f"{self.name}, scaled by {by} {factor:.2f}x",
                                   per_element={m: c * factor for m, c in self.per_element.items()}, **calibration)

    def own_s(self, method, elements, collectives):
        """Seconds `method` adds to a step of `elements` elements that runs `collectives` collectives. A method the
        machine has no figure for takes its family's (SAME_PASSES: the same passes over the model), else none."""
        per_element = self.per_element.get(method, self.per_element.get(SAME_PASSES.get(method), 0.0))
        return per_element * elements + self.per_collective_s * collectives

    @classmethod
    def from_added_ms(cls, name, elements, added_ms, collectives, floor_ms=None, **settings):
        """From one-rank step times: `added_ms[method]`, the ms a method added to no_exchange's step (`floor_ms`) on
        a model of `elements` elements, where it ran `collectives[method]` collectives a step."""
        hand_over = settings.get("per_collective_s", PER_COLLECTIVE_S)
        return cls(name, {m: (ms / 1e3 - hand_over * collectives.get(m, 0)) / elements for m, ms in added_ms.items()},
                   floor_per_element_s=floor_ms / 1e3 / elements if floor_ms else None, **settings)

    @classmethod
    def from_steps(cls, name, shapes, step_ms, optimizer="sgd", host_collectives=None):
        """From one-rank step times on a model of tensors `shapes` under `optimizer` ("sgd" or "adamw"): `step_ms[method]`, no_exchange's among them
        (benchmarks/overhead.py's rows, or steps timed by hand); the collectives' CPU costs `host_collectives` (by
        transport; default: HOST_COLLECTIVES as measured)."""
        if "no_exchange" not in step_ms:
            raise ValueError("step times without no_exchange's: time the bare optimizer's step beside the methods "
                             "(benchmarks/overhead.py --methods=no_exchange,<methods>) so that the floor is known.")
        added = {m: ms - step_ms["no_exchange"] for m, ms in step_ms.items() if m != "no_exchange"}
        return cls.from_added_ms(name, sum(math.prod(s) for s in shapes), added,
                                 {m: planned_collectives(m, shapes, 2, optimizer) for m in added}, step_ms["no_exchange"],
                                 host_collectives=HOST_COLLECTIVES if host_collectives is None else host_collectives)


#: the probe: one pass reading and writing PROBE_ELEMENTS float32 values (y = 0.5 x + 1), the kind of pass a
#: method's own work is made of; machines are compared by its time (`probe_s`, `Machine.scaled_by_probe`)
PROBE_ELEMENTS = 1 << 24


def probe_s(repeats=7):
    """The median seconds of the probe's pass in this process, on the intra-op threads it trains with (after one
    untimed pass)."""
    import statistics
    import time

    import tensorflow as tf
    with tf.device("/CPU:0"):  # (the published costs it scales are CPU ones)
        x = tf.random.uniform([PROBE_ELEMENTS])
        one_pass = tf.function(lambda x: x * 0.5 + 1.0)
        one_pass(x).numpy()
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            one_pass(x).numpy()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


#: the 25M MLP of the published one-rank tables (benchmarks/wire.py's mlp25m: Dense 1000-3500-3500-2700-10)
MLP25M_SHAPES = [(1000, 3500), (3500,), (3500, 3500), (3500,), (3500, 2700), (2700,), (2700, 10), (10,)]
#: the published one-rank tables (docs/benchmarks.md, "What compression costs"; the 25M MLP, one intra-op thread,
#: TensorFlow's BFC allocator, each method's step taken in turn with the floor's): what each method added to
#: no_exchange's step, ms, with that floor (no_exchange's step) and the probe's pass (probe_s) in the same run, ms.
#: Both tables ran on one 2-core AMD EPYC Zen 4 (AVX-512) within twenty minutes; tests/test_cost.py holds them to
#: the published tables.
PUBLISHED_ADDED_MS = {
    "sgd": ("2-core AMD EPYC Zen 4, momentum SGD (overhead.py, 2026-12-08)", 147.5, 23.4,
            dict(none=-26.2, fp16=-17.7, horovod_fp16=5.0, onebit=-6.2, quantize8=12.0, quantize4=8.0, topk=6.3,
                 powersgd=4.4, sketch=46.0)),
    "adamw": ("2-core AMD EPYC Zen 4, AdamW (overhead.py, 2026-12-08)", 185.3, 22.1,
              dict(none=21.4, fp16=27.1, horovod_fp16=8.5, onebit=-45.0, quantize8=-14.7, quantize4=-22.8,
                   topk=-37.7, powersgd=-23.4)),
}

# The GPU kernels on an H100 (docs/gpu.md, ms per 2^26 elements): each method's worker-side and receiving-side kernels
# summed (encode with the residual, the mean of 4 payloads, the momentum feed), TensorFlow's glue not counted.
_GPU_MS = dict(fp16=0.186 + 0.188 + 0.412, horovod_fp16=0.186 + 0.188, onebit=0.629 + 0.606 + 0.469,
               onebit_oneway=0.629 + 0.606 + 0.469, quantize8=0.474 + 0.461 + 0.469, quantize4=0.440 + 0.467 + 0.469,
               topk=0.771 + 0.399 + 0.045 + 0.064 + 0.469, powersgd=4 * 0.469, sketch=2.706 + 0.516 + 0.111)
H100 = Machine("NVIDIA H100 (the GPU kernels' timings, docs/gpu.md)",
               {m: ms / 1e3 / 2 ** 26 for m, ms in _GPU_MS.items()}, per_collective_s=50e-6)


@functools.cache
def published_cpu(optimizer="sgd"):
    """The Machine of the published one-rank CPU table under `optimizer` ("sgd" or "adamw")."""
    if optimizer not in PUBLISHED_ADDED_MS:
        raise ValueError(f"optimizer={optimizer!r}: the published CPU tables are for {sorted(PUBLISHED_ADDED_MS)}.")
    name, floor_ms, probe_ms, added = PUBLISHED_ADDED_MS[optimizer]
    elements = sum(math.prod(s) for s in MLP25M_SHAPES)
    return Machine.from_added_ms(name, elements, added, {m: planned_collectives(m, MLP25M_SHAPES, 2, optimizer)
                                                         for m in added}, floor_ms, probe_s=probe_ms / 1e3,
                                 host_collectives=HOST_COLLECTIVES)


# -- bytes and collectives, as the optimizer plans them -------------------------------------------------------------
def model_shapes(parameters, width=4096):
    """Stand-in tensors for a model known only by its parameter count: matrices of `width` columns (a transformer's
    projections), the rest one vector."""
    rows, rest = divmod(int(parameters), width)
    return [(width, width)] * (rows // width) + ([(rows % width, width)] if rows % width else []) + (
        [(rest,)] if rest else [])


def _plan(method, shapes, size, optimizer, overrides=None):
    """The exchanges hc.DistributedOptimizer plans for `method` (a name of hc.methods' compressions, its defaults
    replaced by `overrides`) wrapping `optimizer` ("sgd" or "adamw": the update rule's measured defaults) on tensors
    of `shapes` at `size` ranks: (the buckets' exchanges, the dense rest's)."""
    import tensorflow as tf
    from hvd_compress import exchange, methods, rules
    from hvd_compress.compressor import NoneCompressor
    from hvd_compress.gradient_exchange import (DEFAULT_FUSION_THRESHOLD_BYTES, DEFAULT_MIN_COMPRESS_SIZE, Layout,
                                                plan_buckets)
    compression = methods.compression(method, **(overrides or {}))
    if compression.requires_optimizer:  # the rule's measured defaults (1-bit Adam's block size and exchange)
        compression = rules.choose(compression.update_rule, keras_optimizer(optimizer), None).settle(compression)
    specs = [tf.TensorSpec(s, tf.float32) for s in shapes]
    layout = Layout(specs, compression, DEFAULT_MIN_COMPRESS_SIZE, DEFAULT_FUSION_THRESHOLD_BYTES)
    exchanges = [exchange.plan(compression, b) for b in plan_buckets(layout, 0, size, None, "cost")]
    dense = exchange.plan_dense(NoneCompressor if compression.requires_optimizer else compression,
                                [layout.shapes[i] for i in layout.dense], [tf.float32] * len(layout.dense), 0, size,
                                None, None, 1.0, DEFAULT_FUSION_THRESHOLD_BYTES, "cost.dense")
    return exchanges, dense


def _local_settings(method, overrides):
    """A local-step method's settings (hc.methods'), its defaults replaced by `overrides`."""
    from hvd_compress import methods
    return {**methods.LOCAL_STEP_METHODS[method](), **(overrides or {})}


def _local_steps(method, overrides):
    """A local-step method's (sync_every, the compression's name, its overrides)."""
    settings = _local_settings(method, overrides)
    name = _compression_name(settings.get("compression"))
    return settings["sync_every"], name, settings["compression"].arguments if name != "none" else {}


def runs_flat(method):
    """Whether `method` exchanges among all ranks alike, whatever the hosts: Horovod's own allreduce, SGP's messages
    and the local-step methods' syncs have no hierarchical form (hc's hierarchical=True is DistributedOptimizer's)."""
    from hvd_compress import methods
    return method in ("horovod_fp32", "horovod_fp16", "sgp") or method in methods.LOCAL_STEP_METHODS


def planned_bytes(method, shapes, size, optimizer="sgd", overrides=None):
    """Bytes one rank sends per step under `method` (a name of hc.methods, its defaults replaced by `overrides`) on
    tensors of `shapes` at `size` ranks (it receives as many); local steps: a sync's over its H inner steps."""
    from hvd_compress import exchange, methods
    elements = sum(math.prod(s) for s in shapes)
    if method in ("horovod_fp32", "horovod_fp16"):
        return exchange.allreduce_bytes((4 if method == "horovod_fp32" else 2) * elements, size)
    if method == "sgp":
        return 4.0 * elements  # the model and its weight to one peer a step (the exponential graph's)
    if method in methods.LOCAL_STEP_METHODS:
        every, name, arguments = _local_steps(method, overrides)
        return planned_bytes(name, shapes, size, "sgd", arguments) / every  # (no rule: the pseudo-gradient)
    exchanges, dense = _plan(method, shapes, size, optimizer, overrides)
    return sum(ex.bytes_sent for ex in exchanges) + dense.bytes_sent


def planned_collectives(method, shapes, size=2, optimizer="sgd", overrides=None):
    """Collectives a step runs under `method` on tensors of `shapes` at `size` ranks (local steps: a sync's over H)."""
    from hvd_compress import methods
    if method in ("horovod_fp32", "horovod_fp16", "sgp"):
        return 1  # Horovod's fusion buffer (64 MiB): one fused allreduce; SGP: one message
    if method in methods.LOCAL_STEP_METHODS:
        every, name, arguments = _local_steps(method, overrides)
        return planned_collectives(name, shapes, size, "sgd", arguments) / every
    exchanges, dense = _plan(method, shapes, size, optimizer, overrides)
    return sum(ex.collectives for ex in exchanges) + dense.collectives


def planned_syncs(method, overrides=None):
    """Times a step under `method` makes its ranks meet: once; a local-step method's once in H steps, each of
    Streaming DiLoCo's F fragments once in H (its exchanges run in the background, not its meetings)."""
    from hvd_compress import methods
    if method not in methods.LOCAL_STEP_METHODS:
        return 1.0
    settings = _local_settings(method, overrides)
    return settings.get("fragments", 1) / settings["sync_every"]


def keras_optimizer(name):
    """A Keras optimizer of the kind `name` says ("sgd" or "adamw"): what the update rules are chosen by."""
    import tensorflow as tf
    made = {"sgd": lambda: tf.keras.optimizers.SGD(0.01, momentum=0.9), "adamw": lambda: tf.keras.optimizers.AdamW()}
    if name not in made:
        raise ValueError(f"optimizer={name!r}: the cost model knows {sorted(made)} (Adam and its kinds are 'adamw').")
    return made[name]()


def _compression_name(compression):
    """The hc.methods name of a local-step method's compression (its pseudo-gradient's)."""
    from hvd_compress import methods
    if compression is None:
        return "none"
    for name, make in methods.METHODS.items():
        made = make()
        if type(made) is type(compression) and getattr(made, "arguments", {}) == getattr(compression, "arguments", {}):
            return name
    raise ValueError(f"no hc.methods name for {compression!r}")


# -- the step --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """A predicted step, in seconds, by term; bytes per rank and on a host's link per step."""
    method: str
    compute_s: float
    own_s: float
    link_s: float
    bytes_per_rank: float
    host_link_bytes: float

    @property
    def total_s(self):
        return self.compute_s + self.own_s + self.link_s


def predict(method, shapes, compute_s, cluster, machine, optimizer="sgd", overrides=None, hierarchical=False,
            overlap=False):
    """The step of `method` (a name of hc.methods, its defaults replaced by `overrides`) wrapping `optimizer` ("sgd" or
    "adamw") on a model of tensors `shapes` whose step takes `compute_s` seconds with nothing sent, on `cluster`, with
    `machine`'s own costs.
    hierarchical: hc's hierarchical=True (averaged inside each host, compressed across) where the method has it
    (`runs_flat`: Horovod's rows, SGP and local steps stay flat). overlap: the link's time runs beside the step's
    (SGP's overlap): the longer of the two."""
    elements = sum(math.prod(s) for s in shapes)
    n = cluster.ranks
    hierarchical = hierarchical and not runs_flat(method)
    if n == 1 or method == "no_exchange":
        return Step(method, compute_s, 0.0, 0.0, 0.0, 0.0)
    collectives = planned_collectives(method, shapes, n, optimizer, overrides)
    per_rank = planned_bytes(method, shapes, n, optimizer, overrides)
    on_cpu = machine.host_collectives.get(cluster.transport)
    inside_rate = min(cluster.intra_host_rate, on_cpu.loopback_rate_bps) if on_cpu else cluster.intra_host_rate
    rate = cluster.link.rate_bps
    if hierarchical and cluster.local_size > 1:  # the hosts' compressed exchange; inside, the full-precision stages
        host_link = planned_bytes(method, shapes, cluster.hosts, optimizer, overrides) if cluster.hosts > 1 else 0.0
        inside = 2 * 4 * elements * (cluster.local_size - 1) / cluster.local_size * 8 / inside_rate
        rounds = 2 * (cluster.hosts - 1) + 2 * (cluster.local_size - 1)
    elif cluster.hosts == 1:  # one host: the ring runs inside it, no host link is crossed
        host_link, inside, rounds = 0.0, per_rank * 8 / inside_rate, 2 * (n - 1)
    else:  # a ring through every rank: as fast as its slowest hop, the hosts' links or the hops inside a host
        host_link, inside, rounds = per_rank, 0.0, 2 * (n - 1)
        rate = rate if cluster.local_size == 1 else min(rate, inside_rate)
    link = host_link * 8 / rate + inside + collectives * rounds * cluster.link.latency_s
    if method == "horovod_fp16" and on_cpu:  # the ring's sums, beside its reduce-scatter half (HostCollectives)
        link = link / 2 + max(link / 2, (n - 1) / n * elements * on_cpu.half_sum_per_element_s)
    link += planned_syncs(method, overrides) * cluster.sync_s
    own = machine.own_s(method, elements, collectives)
    if overlap:  # (SGP's messages to one peer: its meeting too runs beside the step)
        link = max(0.0, link - (compute_s + own))
    return Step(method, compute_s, own, link, per_rank, host_link)


def transformer_compute_s(parameters, tokens_per_step, peak_flops=989e12, utilisation=0.4):
    """A transformer's step on one GPU: 6 N tokens FLOPs (forward and backward) at `utilisation` of `peak_flops`
    (an H100's dense bfloat16 989 TFLOP/s at 40%, a well-tuned run's model FLOPs utilisation)."""
    return 6 * parameters * tokens_per_step / (peak_flops * utilisation)
