"""The exchange contract: how payloads travel between ranks, the state each exchange needs, and
the bytes it costs.

An exchange moves one fused bucket of values between ranks; a compressor's `plan(bucket)` makes
it (compressor.py). It declares the state it needs (`state`: StateSpecs with a name, shape and
scope, see state.py), which the GradientExchange creates once and passes to every step as a dict
of variables, and is called once per step:

    exchange(parts, state, step) -> Exchanged(residual, update, state, applied)

`parts` are the bucket's values, one flat float32 tensor per variable (error-fed values, or plain
gradients, as the compressor's update rule says); `step` is a StepInfo (the step number and, where
the rule puts them inside the exchange, learning rate and momentum). It returns, per variable,
this worker's residual (its input less what it sent; None where the rule keeps none) and the mean
update; the new values of its state; and (sketched SGD) the coordinates where it applied the
update. An update may stay encoded (EncodedPart): the optimizer of dist-EF-SGD subtracts it from
its variables in one pass, and the GradientExchange decodes it for everything else (`decoded`).
An exchange works on the parts where they lie, or on their concatenation (`concat`, `split`).

Each knows, from the static layout, the bytes one worker sends per step
(`bytes_sent`), counted for the algorithms Horovod's CPU back ends run:
- allreduce: ring (reduce-scatter + allgather), 2 (n-1)/n of the payload;
- allgather: a worker's payload reaches the n - 1 others;
- alltoall: a worker sends every shard but its own.
A worker receives as many bytes as it sends in all of these.

Every compressed payload carries non-finite values through: a NaN or Inf in
any rank's input makes the affected part of everybody's update non-finite
(the scales of the sign and quantized codes and the top-k selection do this by
construction; random-k adds a one-float "poison" sum), so no rank silently applies a finite update.
"""
import math
from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

import horovod
import horovod.tensorflow as hvd
from hvd_compress import ops
from hvd_compress.compressor import FP16Compressor
from hvd_compress.state import PER_RANK, REPLICATED, SHARDED, StateSpec


def allreduce_bytes(payload_bytes, size):
    """Ring allreduce: reduce-scatter then allgather, 2 (n-1)/n of the payload each."""
    return 2 * (size - 1) * payload_bytes / size if size > 1 else 0.0


def allgather_bytes(payload_bytes, size):
    """Allgather: each worker's payload reaches the n - 1 others."""
    return (size - 1) * payload_bytes if size > 1 else 0.0



def fuse_in_order(nbytes, threshold):
    """Buckets of consecutive items: lists of their positions, each holding at most `threshold` bytes
    (an item larger than that is a bucket of its own). nbytes: each item's bytes, in order."""
    buckets, current, current_bytes = [], [], 0
    for i, size in enumerate(nbytes):
        if current and current_bytes + size > threshold:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    return buckets + [current] if current else buckets


def poison(x):
    """0.0 when x is all finite, else NaN: added to an update, it spreads a non-finite input."""
    return tf.reduce_sum(x * 0.0)



class Bucket(NamedTuple):
    """What an exchange is planned for: one fused bucket on one world."""
    index: int  # position among the buckets (salts shared random draws)
    shapes: list  # of the tensors fused in it, in order
    rank: int
    size: int
    process_set: object
    name: str  # prefix of its collectives' names

    @property
    def sizes(self):
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def num_elements(self):
        return sum(self.sizes)


class StepInfo(NamedTuple):
    """What an exchange may read of the optimizer's step."""
    number: tf.Tensor  # the optimizer's iteration (a tape's exchange counts its own)
    learning_rate: Optional[tf.Tensor] = None  # where the update rule puts lr inside the exchange (else None)
    momentum: float = 0.0  # likewise (else the wrapped optimizer applies its own)
    nesterov: bool = False
    #: lr / the previous step's lr where the rule puts lr inside: residuals of lr-scaled quantities (the
    #: two-way server's) are multiplied by it this step (1 where the rate did not change)
    residual_scale: Optional[tf.Tensor] = None
    #: the worker rule's own values of this step (rules.WorkerRule.begin), which no exchange reads
    rule: object = None


def rescaled(residual, scale):
    """residual * scale (StepInfo.residual_scale), with no pass over it where the scale is 1 or None."""
    if scale is None:
        return residual
    return tf.cond(tf.equal(scale, 1.0), lambda: tf.identity(residual), lambda: residual * scale)




class EncodedUpdate(NamedTuple):
    """A bucket's mean update left as the payloads it travelled in, decoded where it
    is used: the optimizer of dist-EF-SGD subtracts each variable's part from the variable in one
    pass (EncodedPart.subtract_from, one read and one write of the variable, where a decode and
    assign_sub take four streams); everything else gets decode().

    compressor: what decodes them (decode_mean, subtract_mean); payloads: the stacked payloads whose
    mean is the update, as compressor.decode_mean takes them; bounds: the bucket's block bounds (for
    SparseMean, its number of elements)."""
    compressor: object
    payloads: tuple
    bounds: tf.Tensor

    def decode(self):
        return self.compressor.decode_mean(self.payloads, self.bounds)

    def parts(self, sizes):
        """One EncodedPart per variable of these sizes, in the bucket's order."""
        return [EncodedPart(self, int(offset)) for offset in np.cumsum([0, *sizes[:-1]])]


class SparseMean(NamedTuple):
    """The decoder of a sparse mean update (an EncodedUpdate's `compressor`): payloads (indices,
    values), the sums of `count` ranks at increasing, distinct int32 indices of a bucket of `bounds`
    elements. Subtracted from a variable it writes only the indices in the variable's range
    (ops.subtract_sparse_mean), where a decoded mean costs a dense pass to write and one more to
    subtract."""
    count: int

    def decode_mean(self, payloads, size):
        indices, values = payloads
        return ops.scatter_mean(indices, values, [(size,)], self.count)[0]

    def subtract_mean(self, variable, payloads, size, offset):
        indices, values = payloads
        return ops.subtract_sparse_mean(variable, indices, values, offset, self.count)


class EncodedPart(NamedTuple):
    """One variable's elements of an EncodedUpdate, from `offset` in the bucket."""
    update: EncodedUpdate
    offset: int

    def subtract_from(self, variable):
        """variable -= this part of the decoded update, in place (a float32 variable of the part's size)."""
        u = self.update
        return u.compressor.subtract_mean(variable, u.payloads, u.bounds, self.offset)


def subtract(variable, delta):
    """variable -= delta: a dense tensor (cast to the variable's dtype), or an EncodedPart decoded
    straight into the variable."""
    if isinstance(delta, EncodedPart):
        return delta.subtract_from(variable)
    return variable.assign_sub(tf.cast(delta, variable.dtype))



class Exchanged(NamedTuple):
    """What one exchange step returns (Exchange.__call__), per variable of the bucket."""
    residual: Optional[list]  # this worker's residual, a flat tensor per variable; None: the rule keeps none
    update: list  # the mean update of all workers, a flat tensor or an EncodedPart per variable
    state: dict = {}  # new values of the exchange's state, by name
    applied: Optional[tf.Tensor] = None  # indices into the bucket where the update was applied (sketched SGD)


class Exchange:
    """The contract of every exchange (see the module docstring)."""

    #: the StateSpecs this exchange needs, created once by the GradientExchange
    state = ()
    bytes_sent = 0.0
    #: collectives one step runs, one after another (the cost model's hand-over and latency terms)
    collectives = 1
    #: True: the worker's momentum is zeroed where Exchanged.applied says the update was applied
    #: (sketched SGD's momentum masking)
    masks_momentum = False
    #: True: a part may come as Unsummed(value, residual), error feedback's g + e left for the exchange's own
    #: kernel to add on its way (the rule's `feed_apart`); False: every part is a tensor
    adds_residual = False

    def __call__(self, parts, state, step):
        """parts: one flat float32 tensor (or, where `adds_residual`, Unsummed) per variable of the bucket;
        state: {name: variable}; step: a StepInfo. Returns an Exchanged."""
        raise NotImplementedError

    def residual(self, state):
        """Tensors whose global norm is (an estimate of) the error this exchange holds back in its
        own state, beyond the workers' residuals."""
        return []


class Unsummed(NamedTuple):
    """A part a_i = value + residual of an exchange that `adds_residual`, not yet added: error feedback's g_i + e_i,
    which a fused coder reads as two inputs instead of a pass that writes their sum."""
    value: tf.Tensor
    residual: tf.Tensor

    @property
    def shape(self):
        return self.value.shape


def summed(parts):
    """The parts as tensors, each Unsummed one added up."""
    return [p.value + p.residual if isinstance(p, Unsummed) else p for p in parts]


def concat(parts):
    """The bucket's flat vector."""
    return tf.concat(summed(parts), 0)


def split(flat, parts):
    """A flat vector of the bucket (or an EncodedUpdate) cut back into one piece per part."""
    sizes = [int(p.shape[0]) for p in parts]
    if isinstance(flat, EncodedUpdate):
        return flat.parts(sizes)
    return tf.split(flat, sizes)


def decoded(update, sizes):
    """A bucket's update as dense tensors: EncodedParts (all of one EncodedUpdate) decoded once."""
    if update and isinstance(update[0], EncodedPart):
        return tf.split(update[0].update.decode(), sizes)
    return update


class Switching(Exchange):
    """An exchange composed of two, one chosen at every step by `choose()` (a boolean tensor; True:
    `first`): Accordion's low and high compression. Both are in the graph and a switch is a
    variable's value, never a retrace. Each keeps its own state (named `<name>@0`, `<name>@1`),
    which waits unchanged while the other runs; the worker's residual carries across a switch."""

    def __init__(self, first, second, choose):
        self.choices, self.choose = (first, second), choose
        self.state = tuple(spec._replace(name=f"{spec.name}@{k}") for k, ex in enumerate(self.choices)
                           for spec in ex.state)
        self.masks_momentum = any(ex.masks_momentum for ex in self.choices)

    @property
    def chosen(self):
        """The exchange the next step runs (read between steps)."""
        with tf.init_scope():
            return self.choices[0 if bool(self.choose()) else 1]

    @property
    def bytes_sent(self):
        return self.chosen.bytes_sent

    @property
    def collectives(self):
        return self.chosen.collectives

    @property
    def cross_host_bytes(self):
        """hierarchical: the chosen exchange's bytes to other hosts (a flat one, such as the warm-up's
        full-precision mean, counts all it sends)."""
        return getattr(self.chosen, "cross_host_bytes", self.chosen.bytes_sent)

    def _own(self, state, k):
        return {spec.name: state[f"{spec.name}@{k}"] for spec in self.choices[k].state}

    def residual(self, state):
        return [r for k, ex in enumerate(self.choices) for r in ex.residual(self._own(state, k))]

    def __call__(self, parts, state, step):
        sizes = [int(p.shape[0]) for p in parts]

        def run(k):  # tf.cond's branches return tensors: the update decoded, every state value
            result = self.choices[k](parts, self._own(state, k), step)
            new_state = {name: tf.identity(value) for name, value in state.items()}
            new_state.update({f"{name}@{k}": value for name, value in result.state.items()})
            applied = result.applied if self.choices[k].masks_momentum else None
            residual = result.residual if result.residual is not None else [tf.zeros_like(p) for p in parts]
            return (residual, decoded(result.update, sizes), new_state,
                    tf.zeros([0], tf.int32) if applied is None else tf.cast(applied, tf.int32))

        residual, update, new_state, applied = tf.cond(self.choose(), lambda: run(0), lambda: run(1))
        return Exchanged(residual, update, new_state, applied if self.masks_momentum else None)


class FullAllreduce(Exchange):
    """A bucket sent at full precision (Accordion's `Compression.none` setting, or a bucket with a
    tensor the compressor would not shrink): one float32 allreduce; it sends everything, so no
    residual is left."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.bytes_sent = allreduce_bytes(4 * bucket.num_elements, bucket.size)

    def __call__(self, parts, state, step):
        mean = hvd.allreduce(concat(parts), op=hvd.Average, process_set=self.bucket.process_set,
                             name=self.bucket.name)
        return Exchanged([tf.zeros_like(p) for p in parts], split(mean, parts))


class OrderedMean(Exchange):
    """A bucket sent at full precision with a sum whose order is fixed (a warm-up's steps, which a NumPy
    reference replays bit for bit at any world size and launcher): an alltoall sends shard j of every
    rank's vector to rank j, which adds them in rank order (a float32 fold) and multiplies by float32(1/n); an
    allgather brings every mean shard back. Per rank that is 2 (n-1)/n of 4d bytes, what a ring
    allreduce moves. No residual is left."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.shards = [int(n) for n in np.diff(shard_cuts(bucket.num_elements, bucket.size))]
        mine = self.shards[bucket.rank]
        self.bytes_sent = 4 * (bucket.num_elements - mine) + allgather_bytes(4 * mine, bucket.size)
        self.collectives = 2  # alltoall, allgather

    def __call__(self, parts, state, step):
        bucket = self.bucket
        mean = ordered_shard_mean(concat(parts), self.shards, bucket.rank, bucket.size, bucket.process_set,
                                  bucket.name + ".ordered")
        gathered = hvd.allgather(mean, process_set=bucket.process_set, name=bucket.name + ".ordered.allgather")
        return Exchanged([tf.zeros_like(p) for p in parts], split(gathered, parts))


def ordered_shard_mean(flat, splits, rank, size, process_set, name):
    """This rank's shard of the mean of every rank's `flat` (cut into `splits`, one per rank of the
    process set, in its rank order): an alltoall brings every rank's piece of it, added in rank order (a
    float32 fold, ((r0 + r1) + r2) + ...) and multiplied by float32(1/size), which a NumPy reference replays
    bit for bit. The fold is size - 1 adds of one row each: TensorFlow's scan over the rows (tf.math.cumsum,
    the same bits) took 261 ms for 2 rows of 12.6M floats on one core of an AMD EPYC, against 31 for the add."""
    received, _ = hvd.alltoall(flat, splits=splits, process_set=process_set, name=name + ".alltoall")
    rows = tf.reshape(received, [size, splits[rank]])
    total = rows[0]
    for row in range(1, size):
        total = total + rows[row]
    return total * (1.0 / size)  # (TensorFlow's graph makes / n a * (1/n))


class Hierarchical(Exchange):
    """A bucket averaged inside each host at full precision and compressed only across hosts, where
    the host's link is shared (hierarchical=True): with L ranks on each of H hosts,

    1. inside the host, an alltoall in the host's process set gives local rank l shard l of every
       rank's vector, which it adds in local-rank order (ordered_shard_mean): the host's mean, shard l;
    2. across hosts, local rank l adds its error feedback to that shard and exchanges it with the
       compressor's own exchange among the ranks of local rank l on every host (the cross process set):
       h = mean_l + s e;  D = exchange(h);  e = h - sent  (s: StepInfo.residual_scale);
    3. inside the host, an allgather of every shard's D gives each rank the whole update.

    Each host then sends one bucket's compressed payload across, in L shards, where the flat exchange
    sends L payloads. The compressor's worker-side rule (momentum in front, 1-bit Adam's m / d) runs on
    each rank before step 1; the error feedback e is this rank's, of its shard of the host's mean
    (per-rank state, `host_residual`); so is the compressor's own replicated state (PowerSGD's Q: the
    same on every host, not inside one). A compressor that needs whole tensors (`splits_tensors` False:
    PowerSGD's matrices) gives each bucket whole to local rank (bucket index mod L). With one host there
    is nothing to compress (the host's mean is the update), with one rank per host this is the flat
    exchange. `hosts` is a hosts.HostSets; its process sets are resolved before the first call.
    """

    def __init__(self, compressor, bucket, hosts, feedback):
        self.bucket, self.hosts = bucket, hosts
        local_size, local_rank = hosts.local_size, hosts.local_rank
        self.splits_tensors = getattr(compressor, "splits_tensors", True)
        if self.splits_tensors:
            self.splits = [int(n) for n in np.diff(shard_cuts(bucket.num_elements, local_size))]
            shapes = [(self.splits[local_rank],)] if self.splits[local_rank] else []
        else:
            owner = bucket.index % local_size
            self.splits = [bucket.num_elements if j == owner else 0 for j in range(local_size)]
            shapes = list(bucket.shapes) if local_rank == owner else []
        self.shapes = shapes
        if getattr(compressor, "mask_momentum", False):  # (on every rank alike, whatever shard it holds)
            raise ValueError(f"{compressor!r} masks the workers' momentum where its update lands, which a "
                             "hierarchical exchange does not carry back to every rank: use hierarchical=False.")
        self.inner = None
        if shapes and hosts.cross_size > 1:
            self.inner = plan(compressor, Bucket(bucket.index, shapes, hosts.cross_rank, hosts.cross_size,
                                                 hosts.cross, bucket.name + ".cross"))
        self.feedback = feedback and self.inner is not None
        mine = self.splits[local_rank]
        # The inner exchange's replicated state (PowerSGD's Q) is the same on the ranks of one local rank
        # only, and a host's other ranks hold other shards' or none: per-rank state here, which no broadcast
        # from another local rank overwrites.
        inner_state = tuple(spec._replace(scope=PER_RANK) if spec.scope == REPLICATED else spec
                            for spec in (self.inner.state if self.inner is not None else ()))
        self.state = inner_state + ((StateSpec("host_residual", (mine,), PER_RANK),) if self.feedback else ())

    @property
    def cross_host_bytes(self):
        """What one worker sends to other hosts per step (Accordion's inner exchange: at its current setting)."""
        return self.inner.bytes_sent if self.inner is not None else 0.0

    @property
    def collectives(self):
        """The host's alltoall and allgather around the hosts' exchange."""
        return 2 + (self.inner.collectives if self.inner is not None else 0)

    @property
    def bytes_sent(self):
        return hierarchical_bytes(self.bucket.num_elements, self.splits[self.hosts.local_rank], self.cross_host_bytes,
                                  self.hosts.local_size)

    def residual(self, state):
        inner = self.inner.residual({s.name: state[s.name] for s in self.inner.state}) if self.inner else []
        return inner + ([state["host_residual"]] if self.feedback else [])

    def __call__(self, parts, state, step):
        bucket, hosts = self.bucket, self.hosts
        mean = ordered_shard_mean(concat(parts), self.splits, hosts.local_rank, hosts.local_size, hosts.local,
                                  bucket.name + ".local")
        new_state = {}
        if self.inner is None:
            update = mean
        else:
            fed = mean + rescaled(state["host_residual"], step.residual_scale) if self.feedback else mean
            pieces = [fed] if self.splits_tensors else tf.split(fed, [int(np.prod(s)) for s in self.shapes])
            result = self.inner(pieces, {s.name: state[s.name] for s in self.inner.state}, step)
            new_state.update(result.state)
            if self.feedback:
                new_state["host_residual"] = concat(result.residual)
            update = concat(decoded(result.update, [int(p.shape[0]) for p in pieces]))
        gathered = hvd.allgather(update, process_set=hosts.local, name=bucket.name + ".local.allgather")
        return Exchanged(None, split(gathered, parts), new_state)


def hierarchical_bytes(num_elements, mine, cross_host_bytes, local_size):
    """Bytes one worker of a hierarchical exchange sends per step: every shard but its own (`mine` elements)
    to its host's other ranks, its payload to other hosts, and its shard of the update back to the host."""
    return 4 * (num_elements - mine) + cross_host_bytes + allgather_bytes(4 * mine, local_size)


def plan(compressor, bucket):
    """The exchange of `bucket` under `compressor` (None: full precision; also a bucket with a
    tensor the compressor would not shrink)."""
    if compressor is None or not all(compressor.compresses(s) for s in bucket.shapes):
        return FullAllreduce(bucket)
    return compressor.plan(bucket)


def pack_payload(codes, floats):
    """One uint8 buffer per payload: the packed codes, then each float32 array's bytes (per block: a
    scale, an offset...)."""
    return tf.concat([codes] + [tf.reshape(tf.bitcast(f, tf.uint8), [-1]) for f in floats], 0)


def split_payloads(buffer, count, num_bytes, num_blocks, num_floats):
    """Inverse of pack_payload for `count` stacked payloads of one layout: (codes uint8[count, num_bytes],
    then num_floats arrays float32[count, num_blocks])."""
    rows = tf.reshape(buffer, [count, num_bytes + 4 * num_floats * num_blocks])
    floats = [tf.bitcast(tf.reshape(rows[:, num_bytes + 4 * k * num_blocks:num_bytes + 4 * (k + 1) * num_blocks],
                                    [count, num_blocks, 4]), tf.float32) for k in range(num_floats)]
    return (rows[:, :num_bytes], *floats)


class ShardedTwoWay(Exchange):
    """A block code exchanged two-way over a sharded server (alltoall + allgather): dist-EF-SGD's
    two-way onebit and blockwise quantization, so the bytes per worker do not grow with n.

    The bucket's d elements are cut into `size` shards at multiples of 8 (each owns whole bytes
    of a code of 1, 2, 4 or 8 bits per element; the shard cuts are also block cuts). Worker i
    encodes its whole vector, Q_i = C(a_i), keeping e_i = a_i - Q_i; an alltoall sends shard j of
    every Q_i to rank j, which averages them, adds its server residual and encodes again:
        A_j = mean_i Q_i[j] + s e_s;  D_j = C(A_j);  e_s = A_j - D_j
    (s: StepInfo.residual_scale, 1 unless the learning rate is inside and changed); an allgather
    returns every D_j to every rank, which decode the same D. The server residual is sharded
    state: rank j's holds shard j of this world size (none where the compressor keeps no
    server feedback). The update stays encoded (an EncodedUpdate).

    The compressor is the code: `bits` per element, `floats_per_block` float32 values per block,
    `block_size`, `server_feedback`, the worker's `encode_parts(parts, bounds, salt, step) -> ((codes,
    *floats), residual per part)` (parts as the exchange gets them, Unsummed ones too: it `adds_residual`),
    `decode_mean(payloads, bounds, plus=None)` and the server's `recode_mean(payloads, bounds, plus, salt,
    step)`: the code and residual of decode_mean's result (each fused where the code has a kernel for it);
    `salt` tells the draws of
    buckets, ranks, worker and server apart (2 (1024 bucket + rank), + 1 on the server), where the
    code draws at random.
    """

    adds_residual = True

    def __init__(self, compressor, bucket):
        self.compressor, self.bucket = compressor, bucket
        cuts = shard_cuts(bucket.num_elements, bucket.size)
        self.bounds = bounds = np.union1d(ops.layout_bounds(bucket.sizes, compressor.block_size), cuts)
        # For each shard: its element range, block range and payload byte length.
        self.shards = []
        for j in range(bucket.size):
            lo, hi = int(cuts[j]), int(cuts[j + 1])
            first, last = int(np.searchsorted(bounds, lo)), int(np.searchsorted(bounds, hi))
            num_bytes = (hi * compressor.bits + 7) // 8 - lo * compressor.bits // 8 if hi > lo else 0
            self.shards.append(dict(lo=lo, hi=hi, first=first, last=last, num_bytes=num_bytes,
                                    payload=num_bytes + 4 * compressor.floats_per_block * (last - first)))
        mine = self.shards[bucket.rank]
        self.server_bounds = bounds[mine["first"]:mine["last"] + 1] - mine["lo"]
        self.state = ((StateSpec("server_residual", (mine["hi"] - mine["lo"],), SHARDED),)
                      if compressor.server_feedback else ())
        total = sum(s["payload"] for s in self.shards)
        # alltoall: all but my own shard; allgather: my shard to the n - 1 others.
        self.bytes_sent = (total - mine["payload"]) + allgather_bytes(mine["payload"], bucket.size)
        self.collectives = 2  # alltoall, allgather

    def residual(self, state):
        return list(state.values())

    def _split(self, buffer, count, shard):
        return split_payloads(buffer, count, shard["num_bytes"], shard["last"] - shard["first"],
                              self.compressor.floats_per_block)

    def __call__(self, parts, state, step):
        compressor, bucket = self.compressor, self.bucket
        bounds = tf.constant(self.bounds)
        salt = 2 * (bucket.index * 1024 + bucket.rank)  # the worker's draws; + 1: the server's
        (codes, *floats), residual = compressor.encode_parts(parts, bounds, salt, step.number)
        payloads = [pack_payload(codes[s["lo"] * compressor.bits // 8:][:s["num_bytes"]],
                                 [f[s["first"]:s["last"]] for f in floats]) for s in self.shards]
        received, _ = hvd.alltoall(tf.concat(payloads, 0), splits=[s["payload"] for s in self.shards],
                                   process_set=bucket.process_set, name=bucket.name + ".alltoall")
        mine, kept = self.shards[bucket.rank], state.get("server_residual")
        server_bounds = tf.constant(self.server_bounds)
        server_payload, server_residual = compressor.recode_mean(  # A_j = mean_i Q_i[j] + s e_s; D_j = C(A_j)
            self._split(received, bucket.size, mine), server_bounds,
            None if kept is None else rescaled(kept, step.residual_scale), salt + 1, step.number)
        gathered = hvd.allgather(pack_payload(server_payload[0], server_payload[1:]),
                                 process_set=bucket.process_set, name=bucket.name + ".allgather")
        pieces, offset = [], 0
        for s in self.shards:
            pieces.append(self._split(gathered[offset:offset + s["payload"]], 1, s))
            offset += s["payload"]
        update = EncodedUpdate(compressor, tuple(tf.concat(arrays, 1) for arrays in zip(*pieces)), bounds)
        return Exchanged(residual, split(update, parts),
                         {"server_residual": server_residual} if kept is not None else {})


def shard_cuts(num_elements, size):
    """Cuts [0, ..., d] of d elements into `size` shards at multiples of 8 (trailing ones may be
    empty, e.g. 5 elements on 2 ranks: [0, 5, 5]): each shard of a code of 1, 2, 4 or 8 bits per
    element owns whole bytes."""
    shard = math.ceil(num_elements / size / 8) * 8
    return np.array([min(j * shard, num_elements) for j in range(size + 1)], np.int64)


class DenseAllreduce:
    """Tensors that are not compressed, fused into one grouped allreduce (Horovod's own
    path), optionally through a sum-compatible Horovod compressor (none, fp16)."""

    def __init__(self, shapes, dtypes, compression, size, process_set, op, gradient_predivide_factor, name):
        self.compression, self.size, self.process_set, self.op = compression, size, process_set, op
        self.predivide, self.name = gradient_predivide_factor, name
        payload = sum(int(np.prod(s, dtype=np.int64)) * compression.wire_bytes(self.summed_dtype(d))
                      for s, d in zip(shapes, dtypes))
        self.bytes_sent = allreduce_bytes(payload, size)
        self.collectives = 1 if shapes else 0  # one grouped allreduce

    @staticmethod
    def summed_dtype(dtype):
        """Horovod's allreduce has no bfloat16: such tensors are summed as float32 (or travel as
        float16 under Compression.fp16) and cast back."""
        return tf.float32 if tf.as_dtype(dtype) == tf.bfloat16 else tf.as_dtype(dtype)

    def __call__(self, tensors):
        if not tensors:
            return []
        summed = hvd.grouped_allreduce(
            [tf.cast(t, self.summed_dtype(t.dtype)) for t in tensors], op=self.op, compression=self.compression,
            prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
            process_set=self.process_set, name=self.name)
        return [tf.cast(s, t.dtype) for s, t in zip(summed, tensors)]


#: HalfAllreduce's largest piece of one alltoall, per destination (see its docstring): 2 MiB where Gloo's
#: alltoall posts its receives before its sends (Horovod built with patches/horovod-0.28.1.patch), else 512 KiB
HALF_CHUNK_BYTES = 2 << 20 if getattr(horovod, "gloo_receives_first", False) else 1 << 19
#: HalfAllreduce cuts its buffer into pieces at multiples of this many float16 values (64 bytes), so that
#: each piece is a slice of the buffer that shares its memory (TensorFlow copies unaligned slices)
PIECE_ALIGN = 32


class HalfAllreduce:
    """Compression.fp16 in hvd_compress.DistributedOptimizer: 16-bit allreduce over a sharded sum.

    The tensors are fused into buckets of at most fusion_threshold_bytes of float16, each cast
    once, with F16C, into its float16 buffer (ops.half_pack: no float32 concatenation). The
    buffer is cut into pieces of at most HALF_CHUNK_BYTES per destination, and each piece into
    `size` shards (shard_cuts). Per piece, an alltoall of the piece (a slice of the buffer, no
    copy) sends shard j of every rank to rank j, which averages them in float32 and rounds the
    mean to float16 once (ops.half_mean); a second alltoall sends every rank's mean shard to
    every rank, which brings back the whole piece's mean, in order. ops.half_unpack casts the
    pieces straight into each tensor's own dtype. Per rank and bucket of d values that is
    2 (n-1)/n of 2d bytes, as a ring allreduce of float16 moves, but the sum is taken in float32
    (Horovod's fp16 sums in float16 at every hop, and on this CPU at half the speed of a float32
    sum) and every rank decodes the same bits.

    Why pieces, and their size: each piece costs Horovod's per-collective work (about 1 ms at
    10 Gbit/s), so larger pieces are faster there, but stock Gloo's alltoall posts its send before
    its receive: when one rank is ahead, the other's notice that it is ready to receive queues
    behind its own payload, and the two directions take turns (half the link's rate; 4 MiB pieces
    cost 840 ms a step at 1 Gbit/s against 600 for 512 KiB). Horovod built with this project's
    patch posts receives first; then 2 MiB pieces are the measured compromise on the 25M MLP
    (2 ranks: 1 MiB is fastest at 1 Gbit/s and slowest at 10, 4 MiB the reverse). With stock
    Horovod the pieces are 512 KiB, the fastest size there at 1 Gbit/s (docs/algorithms.md,
    "16-bit exchange", measures the sizes).

    bfloat16 gradients travel as float16 (exact for their 8 significant bits; beyond +-65504 they
    become Inf). The mean does not depend on gradient_predivide_factor, which only guards a float16
    sum against overflow.
    """

    def __init__(self, shapes, dtypes, rank, size, process_set, op, fusion_threshold_bytes, name):
        self.shapes, self.dtypes, self.rank, self.size, self.process_set = shapes, dtypes, rank, size, process_set
        self.scale, self.name = (size if op == hvd.Sum else 1), name
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.buckets = fuse_in_order([2 * n for n in sizes], fusion_threshold_bytes)
        # Per bucket: the [begin, end) of every piece, and each piece's shard lengths (rank j owns the j-th).
        self.pieces, self.bytes_sent = [], 0
        for bucket in self.buckets:
            length = sum(sizes[i] for i in bucket)
            count = max(1, math.ceil(2 * length / (HALF_CHUNK_BYTES * size)))
            step = math.ceil(length / count / PIECE_ALIGN) * PIECE_ALIGN
            pieces = []
            for begin in range(0, length, step):
                end = min(length, begin + step)
                shards = [int(n) for n in np.diff(shard_cuts(end - begin, size))]
                pieces.append((begin, end, shards))
                # Every shard but my own to its owner, then my mean shard to the n - 1 others.
                self.bytes_sent += 2 * (end - begin - shards[rank]) + allgather_bytes(2 * shards[rank], size)
            self.pieces.append(pieces)
        self.collectives = 2 * sum(len(p) for p in self.pieces)  # each piece's alltoall and allgather

    def __call__(self, tensors):
        out = [None] * len(tensors)
        for b, (bucket, pieces) in enumerate(zip(self.buckets, self.pieces)):
            packed = ops.half_pack([tensors[i] for i in bucket])
            means = []  # every piece's mean, gathered from its shards' owners, in order
            for t, (begin, end, shards) in enumerate(pieces):
                received = hvd.alltoall(tf.slice(packed, [begin], [end - begin]), splits=shards,
                                        process_set=self.process_set, name=f"{self.name}.{b}.{t}.scatter")[0]
                mean = ops.half_mean(tf.reshape(received, [self.size, shards[self.rank]]))
                means.append(hvd.alltoall(tf.tile(mean, [self.size]), splits=[shards[self.rank]] * self.size,
                                          process_set=self.process_set, name=f"{self.name}.{b}.{t}.gather")[0])
            unpacked = ops.half_unpack(means, [self.shapes[i] for i in bucket], [self.dtypes[i] for i in bucket])
            for i, y in zip(bucket, unpacked):
                out[i] = y * self.scale if self.scale != 1 else y
        return out


def is_fp16(compression):
    """Whether this is Compression.fp16 (passed as the class, as Horovod's is, or an instance)."""
    return compression is FP16Compressor or isinstance(compression, FP16Compressor)


def plan_dense(compression, shapes, dtypes, rank, size, process_set, op, gradient_predivide_factor,
               fusion_threshold_bytes, name):
    """The exchange of the tensors that are not compressed: HalfAllreduce under Compression.fp16,
    else Horovod's grouped allreduce (DenseAllreduce)."""
    if is_fp16(compression):
        return HalfAllreduce(shapes, dtypes, rank, size, process_set, op, fusion_threshold_bytes, name)
    return DenseAllreduce(shapes, dtypes, compression, size, process_set, op, gradient_predivide_factor, name)


class HierarchicalDense:
    """The tensors that are not compressed, under hierarchical=True: Horovod's hierarchical allreduce
    (the algorithm of its NCCL build, which its CPU build does not have), on the hosts' process sets.
    They are fused into one float32 vector; inside the host, local rank l gets shard l of its host's
    mean (ordered_shard_mean); across hosts, the shard is averaged among the ranks of local rank l by
    the flat dense exchange (plan_dense: float32, or 16 bits under Compression.fp16); inside the host,
    an allgather brings every shard back. Each host sends one copy of the vector across, not one per rank.
    """

    def __init__(self, compression, shapes, dtypes, hosts, op, fusion_threshold_bytes, name):
        self.shapes, self.dtypes, self.hosts, self.name = shapes, dtypes, hosts, name
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.scale = hosts.local_size * hosts.cross_size if op == hvd.Sum else 1
        self.splits = [int(n) for n in np.diff(shard_cuts(sum(self.sizes), hosts.local_size))]
        mine = self.splits[hosts.local_rank]
        self.cross = plan_dense(compression, [(mine,)], [tf.float32], hosts.cross_rank, hosts.cross_size,
                                hosts.cross, hvd.Average, 1.0, fusion_threshold_bytes, name + ".cross")
        #: whether this rank's shard travels to other hosts (else the host's mean is the update)
        self.crosses = mine > 0 and hosts.cross_size > 1
        self.collectives = 2 + (self.cross.collectives if self.crosses else 0)
        self.cross_host_bytes = self.cross.bytes_sent if self.crosses else 0.0
        self.bytes_sent = hierarchical_bytes(sum(self.sizes), mine, self.cross_host_bytes, hosts.local_size)

    def __call__(self, tensors):
        if not tensors:
            return []
        hosts = self.hosts
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
        mean = ordered_shard_mean(flat, self.splits, hosts.local_rank, hosts.local_size, hosts.local,
                                  self.name + ".local")
        if self.crosses:
            (mean,) = self.cross([mean])
        gathered = hvd.allgather(mean, process_set=hosts.local, name=self.name + ".local.allgather")
        if self.scale != 1:
            gathered = gathered * self.scale
        return [tf.cast(tf.reshape(g, shape), dtype)
                for g, shape, dtype in zip(tf.split(gathered, self.sizes), self.shapes, self.dtypes)]


def agree_on_finiteness(grads, process_set, name):
    """Makes every rank's gradients NaN when any rank's are not all finite (one scalar allreduce).

    For tf.keras.mixed_precision.LossScaleOptimizer, which decides locally whether a step
    overflowed: after this every rank takes the same skip/apply decision (no rank waits in a
    collective the others skipped), and the loss scale evolves identically on every rank."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in present]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
    everywhere = hvd.allreduce(tf.cast(finite, tf.float32), op=hvd.Min, process_set=process_set, name=name) > 0.5
    # One cond for all the gradients (a cond a gradient made a step's tracing slower, not its run).
    values = tf.cond(everywhere, lambda: values, lambda: [v * tf.constant(np.nan, v.dtype) for v in values])
    agreed = iter(tf.IndexedSlices(v, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices) else v
                  for g, v in zip(present, values))
    return [None if g is None else next(agreed) for g in grads]
