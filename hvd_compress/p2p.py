"""Point-to-point messages between ranks over MPI, carried by one communication thread per process.

The gossip of Stochastic Gradient Push sends each step's mass to one or two peers. Over a collective
(hvd.alltoall) every rank takes part in every exchange, in lockstep: a late rank delays the world. Here a
rank posts its messages (`post`: non-blocking sends to its out-peers, receives from its in-peers) and
picks up what arrived later (`collect`), so the transfer runs on the communication thread while the
next step computes, and a rank waits only for the peers it receives from.

The transport is MPI's (MPI_Isend, MPI_Irecv, MPI_Testall through mpi4py) on a duplicate of
MPI_COMM_WORLD, so its messages never meet Horovod's. Horovod's MPI controller initialises MPI with
MPI_THREAD_MULTIPLE, which a second thread calling MPI needs: the job must be launched with MPI
(`horovodrun --mpi ...` or `mpirun ...`); under Gloo `Mailbox()` refuses with the launch to use.
"""
import atexit
import collections
import logging
import queue
import sys
import threading
import time

import numpy as np

import horovod.tensorflow as hvd

#: How long `collect` waits for a step's messages before it fails (a peer died or hangs).
COLLECT_TIMEOUT_SECONDS = 120.0
#: How long a rank waits at exit for its sends to be delivered and for the other ranks to close.
CLOSE_TIMEOUT_SECONDS = 120.0
#: How often the communication thread asks MPI whether a step's messages arrived (it waits for the next step's
#: messages to send in between).
POLL_SECONDS = 0.0005
#: MPI guarantees tags up to 32767; a step's messages are tagged step mod TAGS.
TAGS = 32768


def mpi_world():
    """mpi4py's MPI module, with MPI already initialised by Horovod with thread support: or a clear error."""
    if not hvd.is_initialized():
        raise RuntimeError("Point-to-point gossip needs Horovod first: call hvd.init().")
    if not hvd.mpi_enabled():
        raise RuntimeError("Point-to-point gossip runs over MPI, and this job was launched with Gloo. Launch with "
                           "MPI (horovodrun --mpi -np N ..., or mpirun -np N ...), or use transport='alltoall'.")
    try:
        import mpi4py
    except ImportError as e:
        raise RuntimeError("Point-to-point gossip needs mpi4py: pip install mpi4py, or use "
                           "transport='alltoall'.") from e
    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # Horovod owns MPI's life
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("Point-to-point gossip needs MPI initialised with MPI_THREAD_MULTIPLE (Horovod asks for "
                           "it unless HOROVOD_MPI_THREADS_DISABLE is set: unset it).")
    return MPI


#: TensorFlow adopts a NumPy array a numpy_function returns without a copy only where its data starts at a multiple
#: of this many bytes (its allocators' alignment); NumPy's own start at 16, and TensorFlow's copy of a 6.4 MB
#: result took 3 ms of a 4 ms round trip (one process, one thread).
TENSORFLOW_ALIGNMENT = 64


def aligned_empty(like):
    """An uninitialised array shaped and typed like `like`, whose data starts at a multiple of TENSORFLOW_ALIGNMENT
    bytes: TensorFlow takes it as a tensor without copying it."""
    raw = np.empty(like.nbytes + TENSORFLOW_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % TENSORFLOW_ALIGNMENT
    return raw[start:start + like.nbytes].view(like.dtype).reshape(like.shape)


def added(arrays):
    """The sum of equally shaped arrays, added in order (((a0 + a1) + a2)...: the bits of np.sum(arrays, axis=0),
    without its copy of them all into one array), in a buffer of aligned_empty's; the array itself when there is
    one."""
    if len(arrays) == 1:
        return arrays[0]
    total = np.add(arrays[0], arrays[1], out=aligned_empty(arrays[0]))
    for array in arrays[2:]:
        np.add(total, array, out=total)
    return total


class Mailbox:
    """This rank's posted messages: `post(step, payload, to, senders)` hands a step's sends and receives to the
    communication thread and returns at once; `collect(step)` waits for them and returns the sum of what the
    senders sent. Messages of several steps may be in flight at once; each is collected once, in any order."""

    def __init__(self, max_drift=None):
        """max_drift: None, or D >= 1: the messages of a rank's step t are collected only once every rank has posted
        its step t - D (an MPI_Ibarrier per step, on the communication thread): docs/algorithms.md, "How far ranks
        drift apart"."""
        MPI = mpi_world()
        self.max_drift = max_drift
        self.MPI, self.comm = MPI, MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.jobs, self.pending, self.failure = queue.Queue(), {}, None
        self.thread = threading.Thread(target=self._run, name="hvd_compress.p2p", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # after Horovod's own exit handler is registered: runs before it

    def post(self, step, payload, to, senders):
        """Sends `payload` (a NumPy array) to each rank in `to`; receives one array like it from each rank in
        `senders`. Returns at once. `payload` is sent from where it lies (where it is contiguous) and must not change
        until its sends complete, which may be after `collect`: a numpy_function's input array is TensorFlow's copy
        of the tensor, which nothing else uses."""
        step, payload = int(step), np.ascontiguousarray(payload)
        if step in self.pending:
            raise ValueError(f"step {step}'s messages were posted already and not collected.")
        done = threading.Event()
        inbox = [aligned_empty(payload) for _ in senders]
        self.pending[step] = (done, inbox, list(senders), payload)
        self.jobs.put((step, payload, list(to), list(senders), inbox, done))

    def collect(self, step, timeout=None):
        """The sum of what step `step`'s senders sent (zeros like the payload when there were none), once it all
        arrived."""
        done, inbox, senders, payload = self.pending.pop(int(step))
        timeout = COLLECT_TIMEOUT_SECONDS if timeout is None else timeout
        if not done.wait(timeout):
            raise TimeoutError(f"rank {self.rank}: step {step}'s messages from ranks {senders} did not arrive within "
                               f"{timeout:.0f} s (a peer died, hangs, or is more than that far behind).")
        if self.failure is not None:
            raise RuntimeError(f"rank {self.rank}: the communication thread failed") from self.failure
        return added(inbox) if inbox else np.zeros_like(payload)

    def collect_pending(self):
        """The sum of what was posted and not yet collected (None where nothing is pending): a step's messages,
        whatever its number (a step that loss scaling skipped posted nothing)."""
        arrived = [self.collect(step) for step in sorted(self.pending)]
        return added(arrived) if arrived else None

    def close(self):
        """Stops the communication thread once this rank's sends are delivered and every rank closed its mailbox
        (at most CLOSE_TIMEOUT_SECONDS): registered at exit, before Horovod's own shutdown. The ranks meet because
        Horovod's shutdown on one rank finalises MPI on all of them: a rank that closed and left would otherwise
        pull MPI away from a rank whose thread is still delivering (MPI_Waitall after MPI_Finalize: a crash).
        After an uncaught error it aborts the job instead."""
        if getattr(sys, "last_value", None) is not None:
            # An uncaught error ends this rank. MPI_Finalize waits for every rank, so a rank that hangs (the peer
            # whose messages did not arrive) would hold this one, and the job, forever: abort the job instead,
            # as mpi4py's `python -m mpi4py` does on an uncaught error.
            logging.getLogger("hvd_compress").error(
                "rank %d: an uncaught error ends this rank; aborting the MPI job (MPI_Abort) so that no rank waits "
                "for it.", self.rank)
            self.MPI.COMM_WORLD.Abort(1)
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(CLOSE_TIMEOUT_SECONDS + 1)

    def _run(self):
        """The communication thread: posts each step's receives and sends as soon as the step is handed over, and
        marks a step done once its receives completed, polling every step in flight: a step whose messages are late
        holds back neither the posting of the next steps nor their completion (a large message moves only once
        its receive is posted: MPI's rendezvous). A send completes when its receiver takes it, which this rank
        does not wait for: it holds the payload until then."""
        MPI, sending, arriving = self.MPI, [], []  # arriving: (requests, done event) of each step in flight
        reached = collections.deque()  # max_drift: one Ibarrier per posted step, oldest first (every rank posts
        # the same steps in the same order, so the barriers pair up by count)
        while True:
            try:  # waits for the next step's job, or, while anything is in flight, polls MPI every POLL_SECONDS
                job = self.jobs.get(timeout=POLL_SECONDS if arriving or sending else None)
            except queue.Empty:
                job = ()
            if job is None:  # close(); MPI is finalised already after the user's own hvd.shutdown()
                if not MPI.Is_finalized():
                    self._wait_at_exit([request for request, _ in sending]
                                       + [r for requests, _ in arriving for r in requests]
                                       + list(reached) + [self.comm.Ibarrier()])
                return
            try:
                if job:
                    step, payload, to, senders, inbox, done = job
                    tag = step % TAGS
                    waits = [self.comm.Irecv(buffer, source=s, tag=tag) for s, buffer in zip(senders, inbox)]
                    sending += [(self.comm.Isend(payload, dest=r, tag=tag), payload) for r in to]
                    if self.max_drift:
                        reached.append(self.comm.Ibarrier())
                        while len(reached) > self.max_drift:  # the barrier of the step D posts back
                            waits.append(reached.popleft())
                    arriving.append((waits, done))
                still = []
                for waits, done in arriving:
                    if MPI.Request.Testall(waits):
                        done.set()
                    else:
                        still.append((waits, done))
                arriving = still
                sending = [(request, held) for request, held in sending if not request.Test()]
            except Exception as e:  # reported by collect
                self.failure = e
                for _, done in arriving:
                    done.set()
                if job:  # its receives may not have been posted
                    job[-1].set()
                arriving = []

    def _wait_at_exit(self, requests):
        """Until `requests` completed (or CLOSE_TIMEOUT_SECONDS passed: a warning), polling: MPI's own wait spins,
        taking a core from the ranks still computing."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_SECONDS
        while not self.MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                logging.getLogger("hvd_compress").warning(
                    "rank %d: point-to-point gossip gave up waiting for the other ranks at exit after %.0f s.",
                    self.rank, CLOSE_TIMEOUT_SECONDS)
                return
            time.sleep(POLL_SECONDS)
