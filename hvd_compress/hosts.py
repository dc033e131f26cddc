"""The hosts of a job, as a hierarchical exchange sees them: which ranks share a host (its local
process set) and which ranks hold the same local rank on every host (their cross process set).

Horovod tells each rank its own place (local_rank, local_size, cross_rank, cross_size) without a
collective, which is all a plan needs: shard sizes and who owns what. The process sets themselves
need every rank's place, so they are made at the first step, when every rank is there
(`HostSets.resolve`, eagerly): one allgather of the places, then `hvd.add_process_set` for each
host and each local rank, in the same order on every rank. A set with the same ranks that already
exists (the user's own, or one made for an earlier plan) is used as it is, so a user's process sets
coexist with these. Adding sets after `hvd.init` needs Horovod's dynamic process sets:
`hvd.init(process_sets="dynamic")`, or HOROVOD_DYNAMIC_PROCESS_SETS=1 in the ranks' environment
(which also allows passing sets of one's own to hvd.init).

A step of a hierarchical exchange ends inside the host (the allgather in the local set), so ranks
on different hosts finish their last step at different moments, and Horovod shuts every rank down
as soon as one rank shuts down (at its exit): the collectives still pending on another host would
fail. Every resolve therefore registers `meet_at_exit`, which runs before Horovod's own
shutdown and waits for every rank.
"""
import atexit
import os
import threading

import horovod.tensorflow as hvd
import tensorflow as tf

EXIT_WAIT_SECONDS = 60.0


def check_hosts_can_be_planned(process_set):
    """Before any collective, at the plan: the reasons a hierarchical exchange cannot run here."""
    if process_set != hvd.global_process_set:
        raise ValueError("hierarchical=True plans over the whole job's hosts; it does not run inside a process "
                         "set of your own. Leave process_set at its default, or hierarchical=False.")
    local_size, cross_size = hvd.local_size(), hvd.cross_size()
    if local_size * cross_size != hvd.size():
        raise ValueError(f"hierarchical=True needs the same number of ranks on every host; this rank's host has "
                         f"{local_size} and the job {hvd.size()} ranks on {cross_size}+ hosts. Launch as many ranks "
                         f"on each host (horovodrun -H a:N,b:N), or use hierarchical=False.")
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0"):
        raise ValueError("hierarchical=True makes a process set for each host and each local rank after "
                         "hvd.init(): start Horovod with hvd.init(process_sets='dynamic'), or set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 in the ranks' environment.")


class HostSets:
    """This rank's host layout, and its local and cross process sets: `local` and `cross` are Horovod
    ProcessSet objects from the plan on, which `resolve` (at the first step, before any of their
    collectives) makes real; an exchange may hold them before that."""

    def __init__(self):
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.cross_rank, self.cross_size = hvd.cross_rank(), hvd.cross_size()
        self.local, self.cross = unresolved_process_set(), unresolved_process_set()
        self.resolved = False

    @property
    def layout(self):
        """"HxL": H hosts of L ranks."""
        return f"{self.cross_size}x{self.local_size}"

    def resolve(self):
        """Every rank, at once, eagerly: finds or makes the local and cross process sets (collectives)."""
        if self.resolved:
            return
        places = hvd.allgather_object((self.cross_rank, self.local_rank), name="hc.hosts")
        made = {}
        for c in sorted({c for c, _ in places}):
            made["local", c] = process_set_of([r for r, (cc, _) in enumerate(places) if cc == c])
        for l in sorted({l for _, l in places}):
            made["cross", l] = process_set_of([r for r, (_, ll) in enumerate(places) if ll == l])
        for placeholder, real in ((self.local, made["local", self.cross_rank]),
                                  (self.cross, made["cross", self.local_rank])):
            placeholder.ranks, placeholder.process_set_id = real.ranks or list(range(hvd.size())), real.process_set_id
        self.resolved = True
        # Registered again at every plan: atexit runs the newest first, and hvd.init (again after an elastic
        # reset) registers Horovod's shutdown.
        atexit.unregister(meet_at_exit)
        atexit.register(meet_at_exit)


def meet_at_exit(timeout=EXIT_WAIT_SECONDS):
    """At the exit of a process that ran hierarchical steps: one global allreduce, so that no rank shuts
    Horovod down (which shuts down every rank) while a rank of another host still finishes its last
    step's collectives inside its host. A rank that exits on an error, while the others wait in a step,
    gives up after `timeout` seconds and exits; Horovod's shutdown then fails the others' step."""
    if not hvd.is_initialized():
        return
    met = threading.Event()

    def meet():
        try:
            hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="hc.hosts.exit")
        except Exception:  # Horovod already shut down by another rank: nothing left to wait for
            pass
        met.set()

    threading.Thread(target=meet, daemon=True).start()
    met.wait(timeout)


def unresolved_process_set():
    """A ProcessSet object without ranks or id yet (HostSets.resolve fills them in)."""
    process_set = hvd.ProcessSet([])
    process_set.ranks = None
    return process_set


def process_set_of(ranks):
    """The process set of these global ranks: an existing one, else a new one (every rank calls it, in the
    same order). The whole job is the global set."""
    ranks = sorted(ranks)
    if ranks == list(range(hvd.size())):
        return hvd.global_process_set
    from horovod.tensorflow.mpi_ops import _basics  # (Horovod exports no public listing of its process sets)
    for set_id, members in _basics._get_process_set_ids_and_ranks().items():
        if sorted(members) == ranks:
            existing = hvd.ProcessSet(ranks)
            existing.process_set_id = set_id
            return existing
    return hvd.add_process_set(ranks)
