"""What the multi-rank benchmarks share: the MLP they time, and starting their ranks.

A benchmark script runs itself under horovodrun with --role=worker; rank 0
writes its figures to the JSON file named by --result, which the launcher
returns. On a shaped network (netns.Network), `run_in_namespaces` starts the
ranks itself, one per namespace, and returns every rank's JSON.
"""
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time


#: Human-readable names of the methods (hc.methods' names, the benchmarks' own variants) for table
#: headers and notes; a method not listed is its own label.
LABELS = {
    "horovod_fp32": "Horovod fp32", "horovod_fp16": "Horovod fp16", "none": "our fp32", "fp16": "our fp16",
    "onebit": "onebit two-way", "onebit_oneway": "onebit one-way", "quantize8": "8-bit quantize",
    "quantize4": "4-bit quantize", "sgp": "SGP",
}


def label(method):
    """The human-readable name of a method (LABELS), or the name itself."""
    return LABELS.get(method, method)


def optimizer(hc, method, base_optimizer, variants=None, **wrapper_kwargs):
    """`base_optimizer` wrapped as `method` trains: one of hc.methods.NAMES, or a variant of the
    benchmark's own (`variants`: name -> (a name of hc.methods, the overrides of its arguments)).
    wrapper_kwargs: the wrapper's own arguments."""
    name, overrides = (variants or {}).get(method, (method, {}))
    return hc.methods.distributed_optimizer(name, base_optimizer, overrides=overrides, **wrapper_kwargs)


def check_names(script, what, chosen, known):
    """Exits with status 1 and a message where `chosen` (names of methods, models...) holds one not in `known`."""
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        sys.exit(f"{script}: unknown {what} {unknown}; known: {list(known)}")


def mlp(keras, layers):
    """A ReLU MLP with these layer widths (input first, logits last)."""
    return keras.Sequential([keras.layers.Input((layers[0],))] + [
        keras.layers.Dense(units, activation="relu" if i < len(layers) - 2 else None)
        for i, units in enumerate(layers[1:])])


def _run_for_json(script, ranks, flags, json_flag, env, timeout, launcher="gloo"):
    """Runs `script <flags> --<json_flag>=<file>` on `ranks` local ranks launched with Gloo or MPI; the JSON
    rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        output = pathlib.Path(tmp) / "output.json"
        horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun), "-np", str(ranks), "-H", f"localhost:{ranks}", f"--{launcher}", sys.executable,
               str(script), *flags, f"--{json_flag}={output}"]
        subprocess.run(cmd, check=True, timeout=timeout, env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        return json.loads(output.read_text())


def run_worker(script, ranks, flags, threads_per_rank=1, timeout=900, launcher="gloo"):
    """Runs `script --role=worker <flags> --result=...` on `ranks` local ranks (launcher: gloo or mpi); rank 0's
    JSON."""
    return _run_for_json(script, ranks, ["--role=worker", *flags], "result",
                         dict(TF_NUM_INTRAOP_THREADS=str(threads_per_rank), TF_NUM_INTEROP_THREADS="1"), timeout,
                         launcher)


def training_step(keras, model, optimizer):
    """A compiled training step, step(x, y) -> loss, on a batch of inputs x and integer labels y.

    The step calls `optimizer.minimize(loss, variables, tape=tape)`, as Keras's
    Model.train_step does: Horovod's own DistributedOptimizer allreduces in
    compute_gradients, hvd_compress's optimizers in apply_gradients.
    """
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    return step


def warm_step(keras, model, optimizer, batch_size, warmup=3):
    """training_step on one fixed random batch, as a function of no arguments, already run `warmup` times."""
    import tensorflow as tf

    train = training_step(keras, model, optimizer)
    x = tf.random.normal([batch_size, *model.input_shape[1:]])
    y = tf.random.uniform([batch_size], 0, model.output_shape[-1], tf.int64)

    def step():
        return train(x, y)

    for _ in range(warmup):
        step().numpy()
    return step


def run_example(script, ranks, flags, timeout=1200):
    """Runs examples/<script> on `ranks` local Gloo ranks with --history; rank 0's history."""
    examples = pathlib.Path(__file__).resolve().parent.parent / "examples"
    return _run_for_json(examples / script, ranks, flags, "history",
                         dict(PYTHONPATH=str(examples), TF_CPP_MIN_LOG_LEVEL="2"), timeout)


# -- ranks in network namespaces (wire.py, time_to_accuracy.py) ------------------------------------
def run_in_namespaces(net, argv, timeout, what, inter_op_threads=1):
    """Runs `argv --result=<file>` as every rank of net (a netns.Network), each in its host's
    namespace; returns the JSON each rank wrote to its file, ordered by rank.

    No horovodrun: this starts Horovod's own RendezvousServer (bound to all addresses; the ranks
    reach it at net.server_address), gives each rank the HOROVOD_* variables that horovodrun's Gloo
    launcher would (horovod.runner.gloo_run.create_run_env_vars and create_slot_env_vars), and
    starts it with net.command(rank, ...). Every rank gets an equal share of the CPU cores for
    TensorFlow's intra-op threads, and `inter_op_threads` threads to run independent ops at once
    (with one, TensorFlow runs the backward pass to its end before any exchange op: docs/architecture.md,
    "Buckets and overlap"). All ranks are killed at the first failure or after `timeout`
    seconds, and the error carries the end of their logs; `what` names the job in it.
    """
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    n = net.num_ranks
    plan = get_host_assignments(parse_hosts(net.slots), n)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    procs = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmp = pathlib.Path(tmp)
        try:
            for slot in plan:
                env = dict(os.environ, **create_run_env_vars(net.server_address, [net.iface], port),
                           **create_slot_env_vars(slot))
                env.update(TF_NUM_INTRAOP_THREADS=str(max(1, (os.cpu_count() or 1) // n)),
                           TF_NUM_INTEROP_THREADS=str(inter_op_threads), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                           TF_CPP_MIN_LOG_LEVEL="2")
                env = {k: str(v) for k, v in env.items()}
                with open(tmp / f"rank{slot.rank}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        net.command(slot.rank, [*argv, f"--result={tmp / f'rank{slot.rank}.json'}"]), env=env,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            wait_all(procs, timeout, lambda: logs(tmp, n), what)
            return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(n)]
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:  # it has just exited
                        pass
                    p.wait()
            server.stop()


def wait_all(procs, timeout, logs_fn, what):
    """Waits for every rank; kills them all at the first failure or at the timeout."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            reason = (f"rank {procs.index(failed[0])} exited with {failed[0].returncode}" if failed
                      else f"timed out after {timeout}s")
            raise RuntimeError(f"{what}: {reason}; the ranks were killed.\n{logs_fn()}")
        time.sleep(0.2)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{what}: exit codes {[p.returncode for p in procs]}.\n{logs_fn()}")


def logs(tmp, n, lines=30):
    return "\n".join(f"--- rank {r} (last {lines} lines) ---\n" + "\n".join(
        (tmp / f"rank{r}.log").read_text(errors="replace").splitlines()[-lines:]) for r in range(n))


def prepare_network_run(script, rates):
    """For a launcher that builds netns.Network's: fails now on a bad rate (not after an hour of
    measurements), exits with status 2 and the reason where this process cannot build the network
    (not root, no iproute2), and makes Ctrl-C (even where a shell started us with SIGINT ignored),
    SIGTERM and SIGHUP end the launcher with an exception, so every finally block (the network's
    removal, the ranks' killing) runs."""
    import netns

    for rate in rates:
        netns.rate_bits(rate)
    reason = netns.check_rights()
    if reason:
        print(f"{script}: cannot run: {reason}.", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))


def command_line(script, **flags):
    """The shell command that runs `script` (a path) with these flags under this interpreter, paths
    relative to the working directory where they lie below it: lists are joined with commas and
    booleans written true/false, as absl reads them."""
    def value(v):
        if isinstance(v, bool):
            return str(v).lower()
        return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return shlex.join([python, os.path.relpath(pathlib.Path(script).resolve()),
                       *(f"--{name}={value(v)}" for name, v in flags.items())])


def load_before():
    """How quiet the machine was before a benchmark started its ranks, for its printout: other work
    moves step times by 30-40% on this 2-core VM."""
    one, five, _ = os.getloadavg()
    return (f"load average before the run {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores; "
            "figures are only comparable within one run on a quiet machine")

