"""Runs a worker script on several local ranks under horovodrun, with a hard timeout.

Each rank of a worker (tests/workers/*.py) writes a JSON result with
`workers/_worker.report`; `run_ranks` returns them ordered by rank. On a
non-zero exit or a timeout, the whole launcher process group is killed and
the test fails with every rank's output (horovodrun prefixes each line with
its rank), so a hang costs at most `timeout` seconds and is easy to read.
"""
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

TESTS = pathlib.Path(__file__).parent.resolve()
WORKERS = TESTS / "workers"
HOROVODRUN = pathlib.Path(sys.executable).with_name("horovodrun")
#: horovodrun's command line without its per-launch build check (see horovodrun_checked.py).
LAUNCHER = [sys.executable, str(TESTS / "horovodrun_checked.py")]
LAUNCHERS = ("gloo", "mpi")


#: How a worker's `tf.keras` becomes each Keras, as for users: TF_USE_LEGACY_KERAS.
KERASES = {"tf_keras": {"TF_USE_LEGACY_KERAS": "1"}, "keras3": {"TF_USE_LEGACY_KERAS": "0"}}
#: Every method, as the workers name them.
METHODS = ["onebit", "onebit_oneway", "onebit_adamw", "topk", "randomk", "powersgd", "sketch", "fetchsgd",
           "sgp"]
#: One method per kind of state: onebit's server-residual shards, top-k's per-rank residual,
#: PowerSGD's replicated Q, SGP's PushSum weight, 1-bit AdamW's exchanged momentum in Keras's own slots.
#: The smoke subset on the second Keras (where a test
#: runs every method in tf_keras, Keras 3 runs these; all of them pass through the same Keras 3
#: entry, and every method's update rule is checked in both Kerases, test_optimizer.py), and the
#: methods resumed at another world size.
ONE_PER_STATE_KIND = ["onebit", "onebit_adamw", "topk", "powersgd", "sgp"]
#: Methods with no per-rank or sharded state (FetchSGD keeps its state in sketch space, the same on
#: every rank): any file rank 0 writes resumes them exactly, and nothing is reset.
NO_RANK_STATE = ["fetchsgd"]
#: Epochs of the digits runs held next to the uncompressed baseline (workers/train_digits.py).
DIGITS_EPOCHS = 16


def check_sgp_next_to_allreduce(ranks):
    """workers/train_digits.py's "sgp" run (per rank) next to its "none": the consensus model as
    accurate as allreduce SGD within a point, the same on every rank, and one peer's bytes a step."""
    baseline, ours = ranks[0]["none"], ranks[0]["sgp"]
    print(f"{len(ranks)} ranks: SGP consensus {ours['accuracy']:.4f} vs allreduce {baseline['accuracy']:.4f}, "
          f"spread per epoch {ours['spread']}")
    assert ours["accuracy"] >= baseline["accuracy"] - 0.01
    assert all(r["sgp"]["after"] == 0.0 for r in ranks)  # the consensus model is the same everywhere
    assert ours["bytes_sent"] == 4 * (21546 + 1)  # one peer: d floats and the weight


def methods_in(keras):
    return METHODS if keras == "tf_keras" else ONE_PER_STATE_KIND


def worker_env(extra=None):
    """Environment for ranks: one TF thread each (ranks share the machine's cores)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "examples"), str(TESTS.parent),
                                     env.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_NUM_INTRAOP_THREADS": "1",
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # Horovod's background loop negotiates the collectives every HOROVOD_CYCLE_TIME ms. The suite runs
        # two launches at once on 2 cores, where a shorter cycle's busy negotiation takes time from the ranks
        # that compute: test_hosts.py and test_accordion.py side by side took 338 s at 0.1 ms, 297 s at 1 ms
        # (Horovod's default) and 309 s at 5 ms (one run each). Per-step results do not change. Where nothing
        # is queued the loop rests, as for users (this project's Horovod, HOROVOD_IDLE_CYCLE_TIME).
        "HOROVOD_CYCLE_TIME": "1",
        # Under an MPI launch, a rank that waits in MPI (Horovod's negotiation, the gossip's messages) spins
        # on its core unless told to yield, and Open MPI sees no oversubscription in -H localhost:N: the
        # 5-rank PushSum test took 126 s alone without this, 65 s with it (2 AMD EPYC cores).
        "OMPI_MCA_mpi_yield_when_idle": "1",
    })
    env.update(extra or {})
    env["HC_HOROVOD_BUILT"] = horovod_built()
    return env


@functools.cache
def horovod_built():
    """The controllers Horovod was built with ("gloo,mpi"), asked once per test session as
    horovodrun asks before each launch."""
    import horovod.tensorflow as hvd
    return ",".join(name for name, built in (("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built())) if built)


def run_ranks(worker, *args, np=2, launcher="gloo", timeout=240, env=None):
    """Runs tests/workers/<worker> on `np` ranks; returns the per-rank result dicts."""
    return _launch(launch_command(np, launcher), worker, args, np, f"{worker} on {np} ranks ({launcher})", timeout,
                   env)


def launch_command(np, launcher):
    """horovodrun's command line for `np` ranks on this machine, launched with "gloo" or "mpi"."""
    assert launcher in LAUNCHERS, launcher
    return [*LAUNCHER, "-np", str(np), "-H", f"localhost:{np}", f"--{launcher}"]


def check_identical_per_world_size(results, world_sizes):
    """For workers that run several world sizes in one launch (workers/_worker.init_world_sizes)
    and report {"digests": {"<n>/<case>": digest}}: every size in `world_sizes` ran, each case on
    all of its n ranks, which hold bit-identical results."""
    by_case = {}
    for result in results:
        for case, digest in result["digests"].items():
            by_case.setdefault(case, []).append(digest)
    assert {int(case.split("/")[0]) for case in by_case} == set(world_sizes), sorted(by_case)
    for case, digests in by_case.items():
        assert len(digests) == int(case.split("/")[0]) and len(set(digests)) == 1, (case, digests)


def run_elastic(worker, *args, hosts=("localhost:3",), min_np=2, timeout=300, env=None):
    """Runs tests/workers/<worker> as an elastic Gloo job on this machine: starts with `hosts` ("name:slots",
    names of this machine: localhost, 127.0.0.1, which Horovod takes for two hosts); the host-discovery script
    answers the lines of the file $HC_SLOTS_FILE, which the worker may rewrite to resize the world. Returns
    the result dicts of the ranks at the end (the worker must end with `hosts`' slots). A removed rank aborts
    itself (Horovod's way), which is not a failure of the job."""
    np = sum(int(h.split(":")[1]) for h in hosts)
    with tempfile.TemporaryDirectory(prefix="hvdslots-") as slots_dir:
        slots = pathlib.Path(slots_dir) / "slots"
        slots.write_text("".join(f"{h}\n" for h in hosts))
        cmd = [*LAUNCHER, "-np", str(np), "--min-np", str(min_np), "--max-np", str(np),
               "--host-discovery-script", str(WORKERS / "discover_hosts.sh"), "--network-interface", "lo",
               "--gloo", "--elastic-timeout", "60"]
        # Survivors wait in hvd.init() while a new worker imports TensorFlow: longer than Gloo's 30 s.
        env = dict(env or {}, HC_SLOTS_FILE=str(slots), HOROVOD_GLOO_TIMEOUT_SECONDS="120")
        return _launch(cmd, worker, args, np, f"{worker}, elastic from {','.join(hosts)}", timeout, env)


def log_launch(what, started):
    """With HC_LAUNCH_LOG=<file>, appends a JSON line per launch (test, launch, seconds): where the suite's
    time goes (`pytest --durations` counts a module fixture's launches in its first test only)."""
    if os.environ.get("HC_LAUNCH_LOG"):
        with open(os.environ["HC_LAUNCH_LOG"], "a") as log:
            log.write(json.dumps(dict(test=os.environ.get("PYTEST_CURRENT_TEST", ""), launch=what,
                                      seconds=round(time.monotonic() - started, 1))) + "\n")


def _launch(launcher_cmd, worker, args, np, what, timeout, env):
    """Runs `launcher_cmd python worker --out_dir ... args`; the rank<N>.json of ranks 0..np-1."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdrun-") as out_dir:
        cmd = [*launcher_cmd, sys.executable, str(WORKERS / worker), "--out_dir", out_dir, *map(str, args)]
        returncode, output = _run(cmd, what, timeout, env)
        if returncode != 0:
            pytest.fail(f"{what} exited with {returncode}.\n$ {' '.join(cmd)}\n{output}", pytrace=False)
        results = []
        for rank in range(np):
            path = pathlib.Path(out_dir) / f"rank{rank}.json"
            if not path.exists():
                pytest.fail(f"rank {rank} of {what} wrote no result.\n{output}", pytrace=False)
            results.append(json.loads(path.read_text()))
        log_launch(what, started)
        return results


def run_failing(worker, *args, np=2, launcher="gloo", timeout=240, env=None):
    """Runs tests/workers/<worker> on `np` ranks, a job that must fail: returns its output once it ended with an
    error, and fails the test if it succeeded or was still running after `timeout` seconds (a hang)."""
    what = f"{worker} on {np} ranks ({launcher}), which must fail"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdrun-") as out_dir:
        cmd = [*launch_command(np, launcher), sys.executable, str(WORKERS / worker), "--out_dir", out_dir,
               *map(str, args)]
        returncode, output = _run(cmd, what, timeout, env)
    if returncode == 0:
        pytest.fail(f"{what} succeeded.\n$ {' '.join(cmd)}\n{output}", pytrace=False)
    log_launch(what, started)
    return output


def _run(cmd, what, timeout, env):
    """(exit status, output) of `cmd` in a session of its own, killed with everything it started, and the test
    failed, after `timeout` seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(env), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s and was killed.\n$ {' '.join(cmd)}\n{output}",
                    pytrace=False)
    return proc.returncode, output


def run_hosts(worker, *args, ranks_per_host=(2, 2), timeout=240, env=None):
    """Runs tests/workers/<worker> as hosts of `ranks_per_host` ranks each, on this machine: Horovod's
    own rendezvous server and Gloo launch environment (horovodrun's), with a host name per host, so Horovod's
    local and cross ranks and sizes are those of the layout, and dynamic process sets on (env may turn them off). The ranks talk over
    the loopback (benchmarks/wire.py --hosts puts each host in a network namespace of its own). Returns the
    per-rank result dicts; kills every rank at the first failure or after `timeout` seconds."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    n = sum(ranks_per_host)
    plan = get_host_assignments(parse_hosts(",".join(f"hc-host{h}:{k}" for h, k in enumerate(ranks_per_host))), n)
    what = f"{worker} on hosts of {'+'.join(map(str, ranks_per_host))} ranks"
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    procs = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdhosts-") as out_dir:
        try:
            for slot in plan:
                rank_env = dict(worker_env(dict(dict(HOROVOD_DYNAMIC_PROCESS_SETS="1"), **(env or {}))),
                                **create_run_env_vars("127.0.0.1", ["lo"], port), **create_slot_env_vars(slot))
                with open(pathlib.Path(out_dir) / f"rank{slot.rank}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, str(WORKERS / worker), "--out_dir", out_dir, *map(str, args)],
                        env={k: str(v) for k, v in rank_env.items()}, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait()
            server.stop()
        logs = "\n".join(f"--- rank {r} ---\n" + (pathlib.Path(out_dir) / f"rank{r}.log").read_text()[-4000:]
                         for r in range(n))
        if any(p.returncode for p in procs):
            pytest.fail(f"{what}: exit codes {[p.returncode for p in procs]} (killed at the first failure or after "
                        f"{timeout}s).\n{logs}", pytrace=False)
        log_launch(what, started)
        return [json.loads((pathlib.Path(out_dir) / f"rank{r}.json").read_text()) for r in range(n)]
