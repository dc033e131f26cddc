"""Collectives that run while training goes on: one background thread per process runs posted exchanges in order.

Streaming DiLoCo (hvd_compress.diloco) starts a fragment's exchange at one inner step and uses its result
`sync_delay` steps later. A Horovod op inside a training step ends with the step, so the exchange runs here
instead: the step posts it (`post`, from a tf.numpy_function, which returns at once) and a later step waits for
it (`wait`). Horovod takes ops from any thread; every rank posts the same exchanges in the same order (each
rank's steps are the same program), so the collectives pair up. The exchange writes its result into
variables (replicated state), so a checkpoint or model file written after `wait_all` holds it.

Horovod runs one collective at a time: a collective the training step itself issues meanwhile (a
LossScaleOptimizer's per-step finiteness agreement) waits for the exchange in flight.
"""
import atexit
import queue
import threading

#: How long `wait` waits for an exchange (a 100 MB fragment at 10 Mbit/s: 80 s) before it fails: a rank died
#: or never posted it.
WAIT_TIMEOUT_SECONDS = 600.0


class BackgroundExchanges:
    """Runs posted callables on one thread, in the order posted; `wait(key)` blocks until the one posted under
    `key` finished (and raises what it raised)."""

    def __init__(self, name):
        self.name = name
        self._jobs = queue.Queue()
        self._done = {}  # key -> (threading.Event, [exception or None]) of the last job posted under it
        self._lock = threading.Lock()
        self._thread = None

    def post(self, key, run, *args):
        """Queues run(*args) under `key`; a key's earlier job must have been waited for."""
        with self._lock:
            if key in self._done and not self._done[key][0].is_set():
                raise RuntimeError(f"{self.name}: exchange {key!r} posted again while the last one is in flight.")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                atexit.register(self.wait_all)  # after hvd.init: runs before Horovod's own shutdown
            self._done[key] = (threading.Event(), [None])
            self._jobs.put((run, args, self._done[key]))

    def wait(self, key, timeout=WAIT_TIMEOUT_SECONDS):
        """Waits for the job posted under `key` (none posted, as after a restore: returns at once)."""
        with self._lock:
            done = self._done.pop(key, None)
        if done is None:
            return
        event, error = done
        if not event.wait(timeout):
            raise TimeoutError(f"{self.name}: exchange {key!r} did not finish in {timeout:.0f} s: a rank died, or "
                               "the ranks did not post the same exchanges.")
        if error[0] is not None:
            raise RuntimeError(f"{self.name}: exchange {key!r} failed") from error[0]

    def posted(self, key):
        """Whether a job was posted under `key` and not yet waited for."""
        with self._lock:
            return key in self._done

    @property
    def in_flight(self):
        with self._lock:
            return [key for key, (event, _) in self._done.items() if not event.is_set()]

    def wait_all(self):
        """Waits for every job posted (before a checkpoint or model file is written, and at exit); their results
        stay where the jobs wrote them, and `wait` on their keys returns at once."""
        with self._lock:
            pending = list(self._done.items())
        for key, (event, error) in pending:
            if not event.wait(WAIT_TIMEOUT_SECONDS):
                raise TimeoutError(f"{self.name}: exchange {key!r} did not finish in {WAIT_TIMEOUT_SECONDS:.0f} s.")
            if error[0] is not None:
                raise RuntimeError(f"{self.name}: exchange {key!r} failed") from error[0]

    def _run(self):
        while True:
            run, args, (event, error) = self._jobs.get()
            try:
                run(*args)
            except BaseException as e:  # re-raised by wait on the training thread
                error[0] = e
            finally:
                event.set()
