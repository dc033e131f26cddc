"""What the multi-rank benchmarks share: the MLP they time, and starting their ranks.

A benchmark script runs itself under horovodrun with --role=worker; rank 0
writes its figures to the JSON file named by --result, which the launcher
returns. On a shaped network (netns.Network), `run_in_namespaces` starts the
ranks itself, one per namespace, and returns every rank's JSON.
"""
import contextlib
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


#: the gossip variants of the benchmarks that run SGP: name -> (a name of hc.methods, its overrides); the _mpi
#: ones send point to point and need an MPI launch
GOSSIP_VARIANTS = {"sgp_overlap": ("sgp", dict(overlap=True)), "sgp_mpi": ("sgp", dict(transport="mpi")),
                   "sgp_overlap_mpi": ("sgp", dict(overlap=True, transport="mpi"))}


def label(method):
    """The human-readable name of a method (LABELS), or the name itself."""
    return LABELS.get(method, method)


def optimizer(hc, method, base_optimizer, variants=None, **wrapper_kwargs):
    """`base_optimizer` wrapped as `method` trains: one of hc.methods.NAMES, or a variant of the
    benchmark's own (`variants`: name -> (a name of hc.methods, the overrides of its arguments)).
    wrapper_kwargs: the wrapper's own arguments."""
    name, overrides = (variants or {}).get(method, (method, {}))
    return hc.methods.distributed_optimizer(name, base_optimizer, overrides=overrides, **wrapper_kwargs)


def example_flags(method):
    """The flags of examples/keras_text.py that run `method`: a name of hc.methods, or a GOSSIP_VARIANTS entry
    (--method=sgp and its arguments as flags)."""
    name, arguments = GOSSIP_VARIANTS.get(method, (method, {}))
    return [f"--method={name}", *(f"--{argument}={value}" for argument, value in arguments.items())]


def check_names(script, what, chosen, known):
    """Exits with status 1 and a message where `chosen` (names of methods, models...) holds one not in `known`."""
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        sys.exit(f"{script}: unknown {what} {unknown}; known: {list(known)}")


def needs_mpi(method):
    """Whether `method` sends point to point over MPI (a GOSSIP_VARIANTS entry with transport="mpi"), which only an
    MPI launch allows."""
    return GOSSIP_VARIANTS.get(method, (None, {}))[1].get("transport") == "mpi"


def check_launcher(script, methods, launcher):
    """Exits with the fix where a method needs an MPI launch (needs_mpi) and the ranks are not launched with MPI."""
    point_to_point = [m for m in methods if needs_mpi(m)]
    if point_to_point and launcher != "mpi":
        sys.exit(f"{script}: methods {point_to_point} send point to point over MPI: add --launcher=mpi.")


def launched(launcher):
    """How a run's ranks started, in words, for a table's note."""
    return {"gloo": "launched with Gloo (Horovod's collectives over Gloo)",
            "mpi": "launched with mpirun (Horovod's collectives over Open MPI)"}[launcher]


def allocator_note(row):
    """A run's CPU allocator, in words, for a table's note (rows from before the allocator was recorded: the
    default)."""
    return ("TensorFlow's BFC allocator on the CPU (TF_CPU_ALLOCATOR_USE_BFC=1)"
            if row.get("tf_cpu_allocator") == "bfc" else "TensorFlow's default CPU allocator")


def table_suffix(row):
    """The suffix of a published table's name: "_mpi" for a run launched with MPI (its tables stand beside the
    Gloo launch's), then "_bfc" for a run with TensorFlow's BFC allocator on the CPU (run_in_namespaces), then
    "_adamw" for a run whose methods wrap AdamW (wire.py's --optimizer; SGD otherwise)."""
    return (("_mpi" if row.get("launcher", "gloo") == "mpi" else "")
            + ("_bfc" if row.get("tf_cpu_allocator", "default") == "bfc" else "")
            + ("_adamw" if row.get("optimizer", "sgd") == "adamw" else ""))


def mlp(keras, layers):
    """A ReLU MLP with these layer widths (input first, logits last)."""
    return keras.Sequential([keras.layers.Input((layers[0],))] + [
        keras.layers.Dense(units, activation="relu" if i < len(layers) - 2 else None)
        for i, units in enumerate(layers[1:])])


#: the text model (time_to_accuracy.py --task=text, wire.py's text24m): the next character from TEXT_CONTEXT
#: characters, each embedded in EMBEDDING numbers, then a wide ReLU MLP
TEXT_CONTEXT, EMBEDDING, TEXT_HIDDEN = 24, 32, (4096, 4096, 1024)


def text_mlp(keras, vocab_size, hidden=TEXT_HIDDEN):
    """The text model: int32 character codes [batch, TEXT_CONTEXT] -> logits over vocab_size characters."""
    return keras.Sequential([keras.layers.Input((TEXT_CONTEXT,), dtype="int32"),
                             keras.layers.Embedding(vocab_size, EMBEDDING), keras.layers.Flatten(),
                             mlp(keras, [TEXT_CONTEXT * EMBEDDING, *hidden, vocab_size])])


def _run_for_json(script, ranks, flags, json_flag, env, timeout, launcher="gloo"):
    """Runs `script <flags> --<json_flag>=<file>` on `ranks` local ranks launched with Gloo or MPI, with the BFC
    allocator unless the environment names one (TF_CPU_ALLOCATORS); the JSON rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        output = pathlib.Path(tmp) / "output.json"
        horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun), "-np", str(ranks), "-H", f"localhost:{ranks}", f"--{launcher}", sys.executable,
               str(script), *flags, f"--{json_flag}={output}"]
        subprocess.run(cmd, check=True, timeout=timeout, env={**allocator_env("bfc"), **os.environ, **env},
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
    shape = [batch_size, *model.input_shape[1:]]
    integer = tf.as_dtype(model.inputs[0].dtype).is_integer  # (the text model's character codes)
    x = (tf.random.uniform(shape, 0, model.output_shape[-1], tf.int32) if integer else tf.random.normal(shape))
    # a label per output position: one per sample, or per token for a sequence model (the transformer)
    y = tf.random.uniform([batch_size, *model.output_shape[1:-1]], 0, model.output_shape[-1], tf.int64)

    def step():
        return train(x, y)

    for _ in range(warmup):
        step().numpy()
    return step


def run_example(script, ranks, flags, timeout=1200, json_flag="history", launcher="gloo"):
    """Runs examples/<script> on `ranks` local ranks (launched with Gloo or MPI) with --<json_flag> (its
    history, or keras_text.py's result); the JSON rank 0 wrote. Under MPI, ranks yield the core while they
    wait (run_in_namespaces)."""
    examples = pathlib.Path(__file__).resolve().parent.parent / "examples"
    env = dict(PYTHONPATH=str(examples), TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")
    return _run_for_json(examples / script, ranks, flags, json_flag, env, timeout, launcher)


# -- ranks in network namespaces (wire.py, time_to_accuracy.py) ------------------------------------
#: how run_in_namespaces starts the ranks
LAUNCHERS = ("gloo", "mpi")
#: Open MPI's TCP transport without its emulated RDMA ("put", on by default), under which two large messages
#: crossing between two ranks in opposite directions took turns: 1,650-1,730 ms for 100 MB each way at 1 Gbit/s,
#: against 840-1,000 without it, what one such message takes alone (Open MPI 4.1.4). Horovod's allreduce, which
#: sends in segments, was not slowed (1,000-1,060 ms with and without).
MPI_TCP_FLAGS = "send,inplace,need-ack,need-csum"
#: For the jobs whose ranks send point to point (needs_mpi): Open MPI's TCP transport with its own progress
#: thread, which serves the sockets as they become ready, where without it a large message moves only when a
#: rank's MPI progress runs (SGP's communication thread polls between its other work, on cores the compute
#: fills). Overlap SGP over MPI, 4 ranks, 25M MLP, 1 Gbit/s: 1,318 and 1,240 ms a step with it, 1,453 and 1,272
#: without, in two runs of each, alternated; Horovod's fp32 allreduce, whose MPI calls block and progress
#: themselves, took 2,323 and 2,309 ms with it against 2,260 and 2,113 without, so its jobs keep the default.
MPI_POINT_TO_POINT_MCA = ("btl_tcp_progress_thread", "1")
#: TensorFlow's CPU allocators a benchmark can give its processes. bfc (TF_CPU_ALLOCATOR_USE_BFC=1) keeps the
#: memory of its tensors and reuses it; TensorFlow's default takes every large tensor's memory afresh from the
#: kernel, which faults in each page. bfc is the benchmarks' default: on a 2-core AMD EPYC the 25M MLP's SGD
#: step without exchange took 878 ms with the default allocator and 434 with bfc (2 ranks), and a pass over a
#: 100 MB tensor 90 against 20 ms (docs/benchmarks.md, "The CPU allocator").
TF_CPU_ALLOCATORS = ("bfc", "default")


def allocator_env(tf_cpu_allocator):
    """The environment that gives a TensorFlow process this CPU allocator (TF_CPU_ALLOCATORS)."""
    if tf_cpu_allocator not in TF_CPU_ALLOCATORS:
        raise ValueError(f"tf_cpu_allocator must be one of {TF_CPU_ALLOCATORS}, got {tf_cpu_allocator!r}.")
    return dict(TF_CPU_ALLOCATOR_USE_BFC=str(int(tf_cpu_allocator == "bfc")))


def run_in_namespaces(net, argv, timeout, what, inter_op_threads=1, launcher="gloo", tf_cpu_allocator="bfc",
                      point_to_point=False):
    """Runs `argv --result=<dir>/rank{rank}.json` as every rank of net (a netns.Network), each in its host's
    namespace under its host's name; returns the JSON each rank wrote (to the path with {rank} filled in),
    ordered by rank.

    No horovodrun. launcher="gloo": this starts Horovod's own RendezvousServer (bound to all addresses; the
    ranks reach it at net.server_address), gives each rank the HOROVOD_* variables that horovodrun's Gloo
    launcher would (horovod.runner.gloo_run.create_run_env_vars and create_slot_env_vars), and starts it with
    net.command(rank, ...). launcher="mpi": one mpirun (Open MPI) with horovodrun --mpi's flags, the hosts'
    names and slots (net.slots) and, as its remote shell, net.rsh_agent: where ssh would log into a host, it
    enters the host's namespace, so mpirun's daemon on that host and the ranks it starts live there; MPI's
    and its daemons' TCP stay on the shaped subnet. Horovod then runs its collectives over MPI, and
    PushSumOptimizer(transport="mpi") can send point to point; Open MPI's TCP transport runs without its
    emulated RDMA (MPI_TCP_FLAGS), and with its own progress thread where `point_to_point` (the job's ranks
    send point to point: MPI_POINT_TO_POINT_MCA). The ranks share this machine's few cores,
    and a rank waiting in MPI polls: mpi_yield_when_idle makes it yield the core while it waits (steps
    1.2-1.9x longer without it on 4 ranks of 2 cores).

    Every rank gets an equal share of the CPU cores for TensorFlow's intra-op threads, and
    `inter_op_threads` threads to run independent ops at once (with one, TensorFlow runs the backward pass
    to its end before any exchange op: docs/architecture.md, "Buckets and overlap"), and TensorFlow's CPU
    allocator `tf_cpu_allocator` (allocator_env; TF_CPU_ALLOCATORS says why bfc). All ranks are killed
    at the first failure or after `timeout` seconds, and the error carries the end of their logs; `what`
    names the job in it.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}.")
    allocator = allocator_env(tf_cpu_allocator)
    n = net.num_ranks
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(max(1, (os.cpu_count() or 1) // n)),
               TF_NUM_INTEROP_THREADS=str(inter_op_threads), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2", **allocator)
    procs = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmp = pathlib.Path(tmp)
        argv = [*argv, f"--result={tmp}/rank{{rank}}.json"]
        try:
            if launcher == "gloo":
                with _rendezvous(net) as rank_env:
                    for r in range(n):
                        procs.append(_start(net.command(r, argv), dict(env, **rank_env(r)), tmp / f"rank{r}.log"))
                    wait_all(procs, timeout, lambda: logs(tmp, [f"rank{r}" for r in range(n)]), what)
            else:
                agent = net.rsh_agent(tmp / "rsh_agent")
                procs.append(_start(["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(n), "-H", net.slots,
                                     "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl",
                                     "^openib", "-mca", "plm_rsh_agent", str(agent),
                                     "-mca", "mpi_yield_when_idle", "1", "-mca", "btl_tcp_flags", MPI_TCP_FLAGS,
                                     "-mca", "oob_tcp_if_include", str(net.subnet),
                                     "-mca", "btl_tcp_if_include", str(net.subnet),
                                     *(["-mca", *MPI_POINT_TO_POINT_MCA] if point_to_point else []), *argv],
                                    env, tmp / "mpirun.log"))
                wait_all(procs, timeout, lambda: logs(tmp, ["mpirun"], lines=60), what)
            return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(n)]
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:  # it has just exited
                        pass
                    p.wait()


def _start(command, env, log_path):
    with open(log_path, "w") as log:
        return subprocess.Popen(command, env={k: str(v) for k, v in env.items()}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def _rendezvous(net):
    """Horovod's RendezvousServer for net's Gloo ranks; yields rank -> the HOROVOD_* variables of that rank."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(net.slots), net.num_ranks)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    try:
        yield lambda rank: dict(**create_run_env_vars(net.server_address, [net.iface], port),
                                **create_slot_env_vars(plan[rank]))
    finally:
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


def logs(tmp, names, lines=30):
    """The last lines of each <name>.log in tmp."""
    return "\n".join(f"--- {name} (last {lines} lines) ---\n" + "\n".join(
        (tmp / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]) for name in names)


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

