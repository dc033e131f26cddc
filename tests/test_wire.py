"""benchmarks/wire.py on a real shaped link at 1 Gbit/s: 2 ranks, each a host in its own network
namespace, 2 hosts of 2 ranks, and an MPI launch on 3 hosts.

Needs root (network namespaces, veths, tc); skipped, with the reason, where
that is missing. The kernel's veth counters must agree with the exchanges' own
byte accounting, the ranks of a host must share its link, and the benchmark must
leave no namespace behind.
"""
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.append(str(BENCHMARKS))
import netns  # noqa: E402


def wire_namespaces():
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(netns.PREFIX)]


def run_wire(tmp_path, *flags, timeout=240):
    """benchmarks/wire.py with these flags (skipped without root); its rows. The network must be gone after it."""
    reason = netns.check_rights()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "wire.json"
    cmd = [sys.executable, str(BENCHMARKS / "wire.py"), "--rates=1gbit", "--models=mlp4m", *flags, f"--out={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher removes its network on SIGTERM
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"wire.py timed out after {timeout}s.\n$ {' '.join(cmd)}\n{output}", pytrace=False)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{output}"
    assert wire_namespaces() == []
    return json.loads(out.read_text()), output


@pytest.mark.usefixtures("network_to_itself")
@pytest.mark.timeout(300)
def test_veth_bytes_match_the_accounting_and_nothing_is_left_behind(tmp_path):
    rows, output = run_wire(tmp_path, "--ranks=2", "--methods=horovod_fp32,onebit,fp16,quantize8,no_exchange",
                            "--steps=5", "--warmup=2", "--idle_s=1", "--timeout=200", "--inter_op_threads=2")
    rows = {r["method"]: r for r in rows}
    assert set(rows) == {"horovod_fp32", "onebit", "fp16", "quantize8", "no_exchange"}
    alone = rows.pop("no_exchange")  # nothing sent: Horovod's control traffic alone crosses the link
    assert alone["accounted"] == 0 and alone["veth_tx_bytes"] < rows["horovod_fp32"]["veth_tx_bytes"] / 100, output
    for method, r in rows.items():
        assert r["ranks"] == 2 and [p["hostname"] for p in r["per_rank"]] == ["hc-ns0", "hc-ns1"]
        assert [p["inter_op_threads"] for p in r["per_rank"]] == [2, 2]
        # TCP payload on the veth (headers taken off per packet) vs what the exchange says it sends: never
        # less, and more by at most Horovod's own control traffic (estimated as its idle rate times the step
        # time: the exchange does not send it, and slower steps carry more of it) and a margin. On onebit's
        # 0.5 MB a step the excess was +2.6% on a quiet machine and reached +6.8% on a loaded 2-core CI
        # machine; the estimate is high where the loop pauses its negotiation during collectives (+8.4%
        # against +2.7% measured on another 2-core machine).
        assert -0.02 < r["wire_vs_accounted"] < r["control_vs_accounted_est"] + 0.05, (
            method, r["wire_vs_accounted"], r["control_vs_accounted_est"], output)
    fp32 = rows["horovod_fp32"]["accounted"]
    assert fp32 >= 20 * rows["onebit"]["accounted"]
    assert rows["fp16"]["accounted"] == fp32 / 2  # its alltoalls move a ring's bytes
    assert fp32 / 3.8 > rows["quantize8"]["accounted"] > fp32 / 4  # 8-bit codes, a scale and offset per 256


@pytest.mark.usefixtures("network_to_itself")
@pytest.mark.timeout(300)
def test_local_steps_are_timed_over_whole_sync_periods(tmp_path):
    """DiLoCo syncs every 20 inner steps: its row is one whole period, ending on the sync, so the mean step and
    the link's bytes per step hold the sync in its share; the kernel's counters agree with its accounting."""
    rows, output = run_wire(tmp_path, "--ranks=2", "--methods=diloco,sparseloco", "--steps=5", "--warmup=2",
                            "--idle_s=1", "--timeout=200")
    rows = {r["method"]: r for r in rows}
    # SparseLoCo accounts 17 kB a step, about as much as Horovod's idle control traffic (+40%), whose estimate varies
    # with the step and the negotiations of each collective: measured from 6 points below it to 13 above.
    negotiation = {"diloco": 0.05, "sparseloco": 0.25}
    for method, r in rows.items():
        assert [len(p["step_times_ms"]) for p in r["per_rank"]] == [20, 20], method
        assert -0.02 < r["wire_vs_accounted"] < r["control_vs_accounted_est"] + negotiation[method], (method, output)
    # The sync of 16 MB is the last step of the period: above the inner steps' median by at least 40% of its ideal time
    # on the link (measured +94 ms over a median of 129, the ideal 128 ms). Not above every inner step: on a loaded
    # 2-core machine one inner step took 417 ms.
    times = rows["diloco"]["per_rank"][0]["step_times_ms"]
    link_ms = 1e3 * 8 * rows["diloco"]["fp32_allreduce"] / 1e9
    assert times[-1] - statistics.median(times[:-1]) > 0.4 * link_ms, (link_ms, times)
    assert rows["diloco"]["accounted"] == pytest.approx(rows["diloco"]["fp32_allreduce"] / 20)
    assert rows["sparseloco"]["accounted"] < rows["diloco"]["accounted"] / 20  # top-k 1%: values and indices


@pytest.mark.usefixtures("network_to_itself")
@pytest.mark.timeout(300)
def test_ranks_of_a_host_share_its_link_and_horovod_sees_the_layout(tmp_path):
    """--hosts=2x2: two hosts of two ranks. Horovod's local and cross ranks are the layout's, and a
    host's link carries only what leaves the host: Horovod's ring allreduce (in rank order) sends one
    rank's share of it across each host boundary, the other rank's stays on the host's loopback. Run in two
    rounds (--rounds), the row is one of them."""
    rows, output = run_wire(tmp_path, "--hosts=2x2", "--methods=horovod_fp32", "--steps=3", "--warmup=2",
                            "--idle_s=0.5", "--timeout=200", "--rounds=2")
    (row,) = rows  # its two rounds, the lower one's row (the lower middle of two)
    assert len(row["step_ms_rounds"]) == 2 and row["step_ms"] == min(row["step_ms_rounds"]), row["step_ms_rounds"]
    assert "(round 2 of 2)" in output and "the round of the median step of 2" in output, output
    assert row["layout"] == "2x2" and row["ranks"] == 4 and row["hosts"] == 2
    ranks = row["per_rank"]
    assert [r["hostname"] for r in ranks] == ["hc-ns0", "hc-ns0", "hc-ns1", "hc-ns1"]
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in ranks] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert len(row["per_host_tx_bytes"]) == 2
    for tx in row["per_host_tx_bytes"]:  # one rank's ring bytes, not both ranks' (+ headers, control traffic)
        assert 0.97 < tx / row["accounted"] < 1.1, (row["per_host_tx_bytes"], row["accounted"], output)


@pytest.mark.usefixtures("network_to_itself")
@pytest.mark.timeout(300)
def test_an_mpi_launch_gossips_point_to_point_over_the_shaped_links(tmp_path, full_matrix):
    """--launcher=mpi on 3 hosts of one rank: mpirun's remote shell puts every rank in its host's namespace
    under its host's name, Horovod runs over MPI, and SGP over MPI's point-to-point transport sends what it
    accounts (one model a step to one peer) over each host's link. (SGP's job runs Horovod too: its barriers
    are allreduces. --full adds Horovod's own fp32 allreduce on the same launch, a job of its own.)"""
    methods = ["horovod_fp32", "sgp_overlap_mpi"] if full_matrix else ["sgp_overlap_mpi"]
    rows, output = run_wire(tmp_path, "--launcher=mpi", "--ranks=3", f"--methods={','.join(methods)}",
                            "--steps=4", "--warmup=2", "--idle_s=0.5", "--timeout=200")
    rows = {r["method"]: r for r in rows}
    assert set(rows) == set(methods)
    for r in rows.values():
        assert r["launcher"] == "mpi" and r["ranks"] == 3
        assert [(p["hostname"], p["local_size"], p["cross_size"]) for p in r["per_rank"]] == [
            (f"hc-ns{h}", 1, 3) for h in range(3)]
    sgp = rows["sgp_overlap_mpi"]
    assert sgp["accounted"] == 4 * (sgp["params"] + 1)  # one model and its PushSum weight, to one peer
    assert abs(sgp["wire_vs_accounted"] - sgp["control_vs_accounted_est"]) < 0.05, output


@pytest.mark.usefixtures("network_to_itself")
def test_point_to_point_gossip_without_an_mpi_launch_is_refused_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "wire.py"), "--methods=horovod_fp32,sgp_mpi",
                           f"--out={tmp_path / 'wire.json'}"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode != 0
    assert "methods ['sgp_mpi'] send point to point over MPI: add --launcher=mpi." in proc.stderr
    assert wire_namespaces() == []
