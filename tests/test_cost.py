"""The cost model (hvd_compress/cost.py), the advisor (python -m hvd_compress.advise) and the checker of the published
shaped-link rows (benchmarks/cost_check.py), as a user calls them."""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from hvd_compress import advise, cost
from hvd_compress import methods as registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")

# What hc.DistributedOptimizer's exchanges counted on 2 ranks for the 25M MLP under momentum SGD (wire.py's accounted
# bytes in the published table wire_mlp25m_bfc): the cost model plans the same exchanges offline.
MEASURED_2_RANKS = dict(horovod_fp32=100_946_840, horovod_fp16=50_473_420, fp16=50_473_420, onebit=3_154_677,
                        quantize8=26_025_452, quantize4=13_407_102, topk=2_018_976, powersgd=365_400)


@pytest.mark.parametrize("method", sorted(MEASURED_2_RANKS))
def test_planned_bytes_are_what_the_optimizer_counted_on_two_ranks(method):
    assert cost.planned_bytes(method, cost.MLP25M_SHAPES, 2) == pytest.approx(MEASURED_2_RANKS[method])


def test_under_adam_the_rules_own_defaults_are_planned():
    """1-bit Adam's defaults (one-way, a scale per 256) settle under Adam: an allgather, whose bytes grow with n,
    where SGD's two-way exchange stays flat."""
    sgd = [cost.planned_bytes("onebit", cost.MLP25M_SHAPES, n, "sgd") for n in (2, 8)]
    adam = [cost.planned_bytes("onebit", cost.MLP25M_SHAPES, n, "adamw") for n in (2, 8)]
    assert sgd[1] < 2 * sgd[0] and adam[1] == pytest.approx(7 * adam[0], rel=1e-3)


def test_local_steps_spread_a_sync_over_its_inner_steps():
    sync = cost.planned_bytes("quantize4", cost.MLP25M_SHAPES, 2)
    assert cost.planned_bytes("diloco_q4", cost.MLP25M_SHAPES, 2) == pytest.approx(sync / 20)


def test_a_step_is_compute_plus_own_plus_link():
    cluster = cost.Cluster(2, cost.Link.parse("1gbit", latency_s=0.0))
    step = cost.predict("horovod_fp32", cost.MLP25M_SHAPES, 0.3, cluster, cost.published_cpu("sgd"))
    assert step.link_s == pytest.approx(MEASURED_2_RANKS["horovod_fp32"] * 8 / 1e9)
    assert step.total_s == pytest.approx(step.compute_s + step.own_s + step.link_s)
    alone = cost.predict("onebit", cost.MLP25M_SHAPES, 0.3, cost.Cluster(1, cluster.link), cost.published_cpu("sgd"))
    assert alone.total_s == 0.3  # one rank sends nothing
    # hierarchical on one host: nothing crosses its link
    host = cost.Cluster(8, cost.Link.parse("10gbit"), hosts=1)
    assert cost.predict("onebit", cost.MLP25M_SHAPES, 0.3, host, cost.H100, hierarchical=True).host_link_bytes == 0


@pytest.mark.parametrize("method", ["horovod_fp32", "horovod_fp16", "sgp", "diloco_q4", "streaming_diloco"])
def test_methods_without_a_hierarchical_form_stay_flat(method):
    """hierarchical=True is DistributedOptimizer's: Horovod's own allreduce, SGP and the local-step methods' syncs
    cross the hosts' links as they do without it, where a compressing method's step changes."""
    cluster = cost.Cluster(8, cost.Link.parse("10gbit"), hosts=2, transport="nccl")
    flat, asked = (cost.predict(method, cost.MLP25M_SHAPES, 0.3, cluster, cost.H100, "adamw", hierarchical=h)
                   for h in (False, True))
    assert asked == flat
    onebit = [cost.predict("onebit", cost.MLP25M_SHAPES, 0.3, cluster, cost.H100, "adamw", hierarchical=h)
              for h in (False, True)]
    assert onebit[0] != onebit[1]


def test_the_ranks_meet_once_a_step_whatever_they_send():
    """Cluster.sync_s: one meeting a step for every exchanging method, however many collectives it runs; a local-step
    method's once in H steps (Streaming DiLoCo's once a fragment); nothing for a step that sends nothing."""
    shapes, machine = cost.MLP25M_SHAPES, cost.published_cpu("sgd")
    apart = cost.Cluster(2, cost.Link.parse("1gbit"))
    meeting = cost.Cluster(2, cost.Link.parse("1gbit"), sync_s=0.006)
    for method, syncs in [("horovod_fp32", 1), ("fp16", 1), ("powersgd", 1), ("diloco_q4", 1 / 20),
                          ("streaming_diloco", 4 / 20)]:  # (4 fragments, each met once in 20 steps)
        added = (cost.predict(method, shapes, 0.1, meeting, machine).link_s
                 - cost.predict(method, shapes, 0.1, apart, machine).link_s)
        assert added == pytest.approx(0.006 * syncs), method
    assert cost.planned_collectives("fp16", shapes) > 1  # (the meeting is not per collective)
    assert cost.predict("no_exchange", shapes, 0.1, meeting, machine).total_s == 0.1


def test_the_checker_fits_the_meeting_from_horovod_fp32s_step():
    """Horovod fp32's step beyond its floor, its own cost and its link's time at the shaped rate's TCP payload is the
    meeting every other row then pays, up to what the layout's slower link showed; the rest, a lower rate. Each fit
    gives back Horovod fp32's step (the latency of its rounds kept)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_check
    import netns
    shapes, machine = cost.MLP25M_SHAPES, cost.published_cpu("sgd")
    cluster = cost.Cluster(2, cost.Link.parse("1gbit", latency_s=50e-6))
    base = cost.predict("horovod_fp32", shapes, 0.2, dataclasses.replace(
        cluster, link=cost.Link(1e9 * netns.TCP_PAYLOAD_FRACTION, 50e-6)), machine).total_s
    bytes_s = MEASURED_2_RANKS["horovod_fp32"] * 8 / (1e9 * netns.TCP_PAYLOAD_FRACTION)

    def fit(step_s, *cap):
        fitted = cost_check.fitted_cluster(cluster, shapes, 0.2, step_s, machine, "sgd", *cap)
        assert cost.predict("horovod_fp32", shapes, 0.2, fitted, machine).total_s == pytest.approx(step_s)
        return fitted

    fitted = fit(base + 0.007)
    assert fitted.sync_s == pytest.approx(0.007) and fitted.link.rate_bps == pytest.approx(0.9564 * 1e9, rel=1e-4)
    # a faster link of the same layout: the meeting at most the slower link's, the rest a lower rate
    capped = fit(base + bytes_s, 0.003)
    assert capped.sync_s == 0.003 and capped.link.rate_bps == pytest.approx(
        MEASURED_2_RANKS["horovod_fp32"] * 8 / (2 * bytes_s - 0.003))
    # a step shorter than the payload rate allows: the rate it shows, no meeting
    fast = fit(base - 0.02 * bytes_s)
    assert fast.sync_s == 0 and 0.9564e9 < fast.link.rate_bps < 1e9


def test_the_checker_fits_a_layouts_meeting_on_its_slowest_link():
    """check_table: the meeting fitted at 1gbit caps the one at 10gbit (listed first); ranks that outnumber the
    machine's cores get none; rows come back in the table's order."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_check
    if not cost_check.FLAGS.is_parsed():
        cost_check.FLAGS(["cost_check"])

    def rows(hosts, fp32_ms):
        return [dict(link=link, hosts=hosts, model="digits_cnn", method=method, **{
            "step ms": str(ms), "accounted bytes/step/worker": "0"})
            for link, fp32 in zip(("10gbit", "1gbit"), fp32_ms)
            for method, ms in (("no_exchange", 4.0), ("horovod_fp32", fp32), ("onebit", 12.0))]

    checked = cost_check.check_table("t", "sgd", "2 CPUs (test)", rows("2x1", (14.0, 11.0)),
                                     cost.published_cpu("sgd"))
    assert [r["link"] for r in checked] == ["10gbit"] * 2 + ["1gbit"] * 2
    sync = {r["link"]: r["sync_ms"] for r in checked}
    assert 5.0 < sync["1gbit"] < 6.5 and sync["10gbit"] == pytest.approx(sync["1gbit"])
    shared = cost_check.check_table("t", "sgd", "2 CPUs (test)", rows("2x2", (14.0, 11.0)), cost.published_cpu("sgd"))
    assert all(r["sync_ms"] == 0 for r in shared)


def test_gloo_adds_float16_on_the_cpu_beside_the_link():
    """Horovod fp16's allreduce over Gloo takes half its link's time (the allgather) plus the longer of the other
    half (the reduce-scatter) and its software sums ((n - 1) / n of the vector a rank, at HOST_COLLECTIVES' cost an
    element): slower than fp32's on a fast link, half of it on a slow one; over MPI and NCCL, half of fp32's on any
    link."""
    published, d = cost.published_cpu("sgd"), sum(math.prod(s) for s in cost.MLP25M_SHAPES)
    sums_s = d / 2 * cost.HOST_COLLECTIVES["gloo"].half_sum_per_element_s

    def links(rate, transport, machine=published):
        cluster = cost.Cluster(2, cost.Link.parse(rate, latency_s=0.0), transport=transport)
        return [cost.predict(m, cost.MLP25M_SHAPES, 0.2, cluster, machine).link_s for m in ("horovod_fp32",
                                                                                           "horovod_fp16")]
    fp32, fp16 = links("10gbit", "gloo")
    assert fp16 == pytest.approx(fp32 / 4 + sums_s) and fp16 > fp32
    fp32, fp16 = links("100mbit", "gloo")
    assert fp16 == pytest.approx(fp32 / 2) and fp16 > sums_s
    for transport, machine in (("mpi", published), ("nccl", cost.H100)):
        fp32, fp16 = links("10gbit", transport, machine)
        assert fp16 == pytest.approx(fp32 / 2), transport


def test_a_ring_runs_at_its_slowest_hop():
    """4 CPU ranks on 2 hosts: the ring's hops inside a host run at the ranks' loopback rate (HOST_COLLECTIVES), so
    a 100 Gbit/s link between hosts does not make it faster; a hierarchical exchange's stages inside the host run at
    the same rate. GPUs on NVLink (no host collectives) run at the cluster's intra_host_rate."""
    loopback = cost.HOST_COLLECTIVES["gloo"].loopback_rate_bps
    cluster = cost.Cluster(4, cost.Link.parse("100gbit", latency_s=0.0), hosts=2)
    flat = cost.predict("horovod_fp32", cost.MLP25M_SHAPES, 0.2, cluster, cost.published_cpu("sgd"))
    assert flat.link_s == pytest.approx(flat.bytes_per_rank * 8 / loopback)
    d = sum(math.prod(s) for s in cost.MLP25M_SHAPES)
    hierarchical = cost.predict("onebit", cost.MLP25M_SHAPES, 0.2, cluster, cost.published_cpu("sgd"),
                                hierarchical=True)
    cross_s = hierarchical.host_link_bytes * 8 / 100e9
    assert hierarchical.link_s == pytest.approx(cross_s + 2 * 4 * d / 2 * 8 / loopback)
    gpus = cost.predict("horovod_fp32", cost.MLP25M_SHAPES, 0.2, cost.Cluster(
        4, cluster.link, hosts=2, intra_host_rate=3.6e12, transport="nccl"), cost.H100)
    assert gpus.link_s == pytest.approx(gpus.bytes_per_rank * 8 / 100e9)


def test_the_collectives_cpu_costs_follow_the_probe_not_a_models_floor():
    published = cost.published_cpu("sgd")
    gloo = published.host_collectives["gloo"]
    slower = published.scaled_by_probe(2 * gloo.probe_s).host_collectives["gloo"]
    assert slower.half_sum_per_element_s == pytest.approx(2 * gloo.half_sum_per_element_s)
    assert slower.loopback_rate_bps == pytest.approx(gloo.loopback_rate_bps / 2)
    assert published.scaled_to(3.0, 1e6).host_collectives == published.host_collectives


def test_one_rank_costs_come_from_step_times_and_follow_the_floor():
    shapes = [(1000, 1000)]
    machine = cost.Machine.from_steps("here", shapes, dict(no_exchange=100.0, topk=110.0))
    collectives = cost.planned_collectives("topk", shapes)
    assert machine.own_s("topk", 1e6, collectives) == pytest.approx(0.010)
    slower = machine.scaled_to(0.200, 1e6)  # a floor twice as long: the method's passes take twice as long
    assert slower.per_element["topk"] == pytest.approx(2 * machine.per_element["topk"])
    with pytest.raises(ValueError, match="no_exchange"):
        cost.Machine.from_steps("here", shapes, dict(topk=110.0))


def test_the_published_costs_follow_the_probe_whatever_the_model():
    """A machine whose probe's pass takes half as long makes each method's passes take half as long, on any model;
    the floor of a model of more compute per parameter does not inflate them (the floor's scaling is the
    calibration model's only). The probe runs here, and is a pass over 16M floats."""
    published = cost.published_cpu("sgd")
    faster = published.scaled_by_probe(published.probe_s / 2)
    assert faster.per_element["quantize8"] == pytest.approx(published.per_element["quantize8"] / 2)
    assert faster.probe_s == published.probe_s / 2 and "probe 0.50x" in faster.name
    here = cost.probe_s(repeats=3)
    assert 1e-4 < here < 1.0  # 64 MiB read and written: well under a second, over a tenth of a ms
    assert cost.Machine("no probe", {"topk": 1e-9}).scaled_by_probe(here).per_element["topk"] == 1e-9


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="link rate 'fast'"):
        cost.Link.parse("fast")
    with pytest.raises(ValueError, match="transport='ucx'"):
        cost.Cluster(2, cost.Link.parse("1gbit"), transport="ucx")
    with pytest.raises(ValueError, match="hosts must divide ranks"):
        cost.Cluster(6, cost.Link.parse("1gbit"), hosts=4)
    with pytest.raises(ValueError, match="sync_s=-0.001"):
        cost.Cluster(2, cost.Link.parse("1gbit"), sync_s=-0.001)
    with pytest.raises(ValueError, match="optimizer='lion'"):
        cost.published_cpu("lion")
    with pytest.raises(ValueError, match="compute_s"):
        advise.advise(1_000_000, 0.0, cost.Cluster(2, cost.Link.parse("1gbit")))
    assert cost.Link.parse("100mbit").rate_bps == 1e8 and cost.Link.parse("400gbit").rate_bps == 4e11


def test_the_advisor_recommends_compression_only_where_it_pays():
    slow = advise.advise(24_223_708, 0.25, cost.Cluster(2, cost.Link.parse("100mbit")), "adamw")
    assert advise.recommend(slow).step.method == "onebit"  # 1-bit Adam: the low-risk method under AdamW
    assert [a.step.total_s for a in slow] == sorted(a.step.total_s for a in slow)
    # one host of 8 GPUs on NVLink, a 125M model: Horovod's allreduce is within the margin of every method
    fast = advise.advise(125_000_000, 0.03, cost.Cluster(8, cost.Link.parse("400gbit"), hosts=8), "adamw", cost.H100)
    assert advise.recommend(fast).step.method in advise.BASELINES
    assert {a.risk for a in slow if a.step.method == "topk"} == {"high"}


def test_the_advisor_takes_a_keras_model():
    import keras
    model = keras.Sequential([keras.layers.Input((100,)), keras.layers.Dense(2000), keras.layers.Dense(10)])
    rows = advise.advise(model, 0.01, cost.Cluster(2, cost.Link.parse("1gbit")))
    assert {a.step.method for a in rows} == set(advise.DEFAULT_METHODS)
    elements = sum(math.prod(v.shape) for v in model.trainable_variables)
    assert next(a for a in rows if a.step.method == "horovod_fp32").step.bytes_per_rank == 4 * elements


def test_the_advisor_command():
    proc = subprocess.run([sys.executable, "-m", "hvd_compress.advise", "--parameters=25m", "--compute_ms=150",
                           "--ranks=4", "--hosts=2", "--link=1gbit", "--optimizer=adamw"],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| method | predicted step ms |" in proc.stdout and "Recommended: " in proc.stdout
    fp16 = {}
    for transport in ("gloo", "mpi"):  # Gloo's float16 sums: Horovod fp16 slower than fp32 at 10 Gbit/s, not MPI's
        proc = subprocess.run([sys.executable, "-m", "hvd_compress.advise", "--parameters=25m", "--compute_ms=150",
                               "--link=10gbit", f"--transport={transport}", "--methods=horovod_fp32,horovod_fp16"],
                              capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        fp16[transport] = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| h")]
    assert fp16 == dict(gloo=["horovod_fp32", "horovod_fp16"], mpi=["horovod_fp16", "horovod_fp32"])
    link_ms = {}
    for sync_ms in (0, 6):  # the ranks' meeting: once a step on Horovod's link, once in 20 steps on DiLoCo's
        proc = subprocess.run([sys.executable, "-m", "hvd_compress.advise", "--parameters=25m", "--compute_ms=150",
                               "--methods=horovod_fp32,diloco_q4", f"--sync_ms={sync_ms}"],
                              capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        link_ms[sync_ms] = {cells[1].strip(): float(cells[5].replace(",", "")) for cells in
                            (line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| h", "| d")))}
    assert link_ms[6]["horovod_fp32"] - link_ms[0]["horovod_fp32"] == pytest.approx(6.0, abs=0.11)
    assert link_ms[6]["diloco_q4"] - link_ms[0]["diloco_q4"] == pytest.approx(0.3, abs=0.11)
    proc = subprocess.run([sys.executable, "-m", "hvd_compress.advise", "--compute_ms=150"],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode != 0 and "--parameters" in proc.stderr


@pytest.mark.timeout(300)
def test_the_host_collectives_benchmark_measures_both_transports(tmp_path):
    """benchmarks/host_collectives.py as its users run it, on a smaller vector: both launchers' figures, and the table
    that names them."""
    out = tmp_path / "host_collectives.json"  # outside the repository: nothing is published
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_collectives.py"), "--elements=2000000",
                           "--repeats=2", f"--out={out}"], capture_output=True, text=True, timeout=280, env=ENV,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["launcher"] for r in rows] == ["gloo", "mpi"] and all(r["ranks"] == 2 for r in rows)
    for r in rows:
        assert all(ms > 0 for ms in r["ms"].values()) and r["loopback_gbit"] > 0 and r["probe_ms"] > 0, r
        assert r["half_sum_ns"] == pytest.approx(1e6 * (r["ms"]["allreduce_fp16"] - r["ms"]["allreduce_fp32_half"])
                                                 / (r["elements"] / 2))
    assert "| gloo | 2 | 2,000,000 |" in proc.stdout and "| mpi | 2 | 2,000,000 |" in proc.stdout


def test_the_checker_reads_every_published_wire_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_check
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = list(cost_check.published_tables(text))
    assert len(tables) >= 8
    for name, command, rows in tables:
        assert rows and {"link", "hosts", "model", "method", "step ms"} <= set(rows[0]), name
        assert all(cost_check.number(r["step ms"]) > 0 for r in rows), name
        for r in rows:  # every method is one the model plans, or said not to be modelled
            resolved = cost_check.resolve(r["method"])
            assert resolved is None or resolved[0] in (*registry.NAMES, "no_exchange"), (name, r["method"])
    assert cost_check.number("295.0 (256-301)") == 295.0 and cost_check.optimizer_of("x --optimizer=adamw") == "adamw"


def test_sgps_overlap_is_read_from_every_row_that_names_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cost_check
    for _ in range(2):  # (reading a row once must not change how the next one reads)
        assert cost_check.resolve("sgp_overlap_mpi") == ("sgp", {}, False, True)
        assert cost_check.resolve("sgp_mpi") == ("sgp", {}, False, False)


@pytest.mark.parametrize("optimizer, section", [("sgd", "overhead_mlp25m_bfc"), ("adamw", "overhead_mlp25m_bfc_adamw")])
def test_the_published_costs_are_the_published_one_rank_tables(optimizer, section):
    """cost.PUBLISHED_ADDED_MS (what the advisor and auto() predict with) is docs/benchmarks.md's one-rank table
    under the optimizer: its floor, its probe and every method's addition, not an older run's."""
    import re
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = re.search(rf"<!-- BEGIN {section} -->\n(.*?)<!-- END {section} -->", text, re.S).group(1)
    cells = {row[0]: row for row in (
        [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| "))}
    _, floor_ms, probe_ms, added = cost.PUBLISHED_ADDED_MS[optimizer]
    assert floor_ms == pytest.approx(float(cells["no_exchange"][1].split()[0]), abs=0.05)
    assert probe_ms == pytest.approx(float(re.search(r"probe_s\) here ([\d.]+) ms", table).group(1)), abs=0.05)
    published = {m: float(row[2].split()[0]) for m, row in cells.items() if m not in ("method", "no_exchange")}
    assert added == pytest.approx(published, abs=0.05)
