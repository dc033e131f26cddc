"""The cost model (hvd_compress/cost.py) against every published shaped-link row: predicted step beside measured.

    .venv/bin/python benchmarks/cost_check.py            # reads docs/benchmarks.md's wire tables, publishes cost_check

Measures nothing: it reads the tables benchmarks/wire.py published in docs/benchmarks.md (every `wire_*` section)
and, for each row, predicts the step from
- compute: the same table's no_exchange row on the same link and layout (the floor); a table without one takes
  Horovod fp32's row less its predicted link time (what a user knows of a job that runs today), and that row is then
  the calibration, not a prediction;
- own: the published one-rank costs under the table's optimizer (cost.published_cpu; `--optimizer` of the command
  that made the table, SGD where it names none), per element, times the table's model's elements;
- bytes and collectives: planned for the table's model by the optimizer's own planning (cost.planned_bytes), on its
  layout (`hosts` column: H hosts of L ranks) at its link rate with the link's `--latency_us`;
- the link's fit, where a table has both a floor and Horovod fp32's row (--fit_link): the shaped rate's TCP payload
  and, for what Horovod fp32's step takes beyond that, the ranks' meeting once a step (cost.Cluster.sync_s), which
  every exchanging row then pays; Horovod fp32's row is then the calibration.
A row is within the bar where |predicted / measured - 1| <= --tolerance. Methods the model does not cover
(Accordion's switching) are listed as such. The table names each source table's machine: the one-rank costs came
from a 2-core AMD EPYC, and the tables from several machines, so a row's error holds the machines' difference too.
"""
import dataclasses
import math
import os
import pathlib
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from absl import app, flags  # noqa: E402

import netns  # noqa: E402
import results  # noqa: E402
import wire  # noqa: E402
from hvd_compress import cost  # noqa: E402
from hvd_compress import methods as registry  # noqa: E402

flags.DEFINE_string("doc", str(results.DOC), "The page whose wire tables are checked.")
flags.DEFINE_list("same_run", [], "WIRE_JSON:OVERHEAD_JSON pairs from one session on one machine (wire.py's and "
                  "overhead.py's --out, same model and optimizer): their rows checked against those one-rank costs, "
                  "in place of the published tables.")
flags.DEFINE_bool("fit_link", True, "Where a table has both no_exchange and Horovod fp32, fit the link to "
                  "Horovod fp32's step (the shaped rate's TCP payload and the ranks' meeting once a step, or a lower "
                  "rate; that row is then calibration): what one timed allreduce tells a user of the link.")
flags.DEFINE_float("tolerance", 0.15, "A prediction within this fraction of the measured step meets the bar.")
flags.DEFINE_float("latency_us", 50.0, "The shaped links' latency per message round, microseconds (veth and a bridge).")
FLAGS = flags.FLAGS
FLAGS.set_default("out", "results/cost_check.json")  # wire.py's flag (its models and methods are read from it)

SECTION = re.compile(r"<!-- BEGIN (wire_\w+) -->\n(.*?)<!-- END \1 -->", re.S)
NOT_MODELLED = {*wire.ACCORDION, wire.AUTO}  # (auto: its row is its choice's)


def published_tables(text):
    """(name, command, rows) of every wire table in a page's text: rows as dicts by column header."""
    for name, body in SECTION.findall(text):
        command = re.search(r"Made by `([^`]*)`", body)
        lines = [line for line in body.splitlines() if line.startswith("|")]
        if len(lines) < 3:
            continue
        header = [cell.strip() for cell in lines[0].strip("|").split("|")]
        rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]
        yield name, command.group(1) if command else "", rows


def number(cell):
    """A table's figure ('1,234.5', '295.0 (256-301)') as a float."""
    return float(cell.split()[0].replace(",", ""))


def optimizer_of(command):
    found = re.search(r"--optimizer[= ](\w+)", command)
    return found.group(1) if found else "sgd"


def launcher_of(command):
    """The transport of a table's collectives: wire.py's --launcher (Gloo where it names none)."""
    found = re.search(r"--launcher[= ](\w+)", command)
    return found.group(1) if found else "gloo"


def machine_of(text, name):
    """The machine named in a table's 'Made by' line."""
    body = re.search(rf"<!-- BEGIN {name} -->\n(.*?)\n", text).group(1)
    found = re.search(r"on (\d+ CPUs \(.*?\))\.$", body)
    return found.group(1) if found else "?"


def model_shapes(name, cache={}):
    """The trainable tensors' shapes of one of wire.py's models."""
    if name not in cache:
        import tensorflow as tf
        cache[name] = [tuple(v.shape) for v in wire.build_model(tf.keras, name).trainable_variables]
    return cache[name]


def resolve(method):
    """wire.py's method name (a table's cell: 'auto (onebit)' is auto's row) -> (hc.methods name, overrides,
    hierarchical, overlap), or None where not modelled."""
    method = method.split(" (")[0]
    if method in NOT_MODELLED:
        return None
    hierarchical = method in wire.HIERARCHICAL
    base = wire.HIERARCHICAL[method] if hierarchical else method
    name, variant = wire.VARIANTS.get(base, (base, {}))
    overlap = bool(variant.get("overlap", False)) if name == "sgp" else False
    overrides = {k: v for k, v in variant.items() if k not in ("transport", "overlap")}
    return name, overrides, hierarchical, overlap


def layout(cell):
    """A table's hosts cell ('2x1', '2x2') -> (ranks, hosts)."""
    hosts, local = (int(x) for x in cell.split("x"))
    return hosts * local, hosts


def check_table(name, optimizer, machine_name, rows, published, transport="gloo"):
    """Every row's prediction: rows as dicts with link, hosts, model, method, step ms and accounted bytes (a published
    table's cells, or a wire.py JSON's made into them); published, the cost.Machine of the one-rank costs."""
    groups = {}  # (link, hosts) -> rows, in the table's order
    for r in rows:
        groups.setdefault((r["link"], r["hosts"]), []).append(r)
    checked, meetings = {}, {}  # meetings: hosts -> the ranks' meeting fitted on its slowest link
    for key in sorted(groups, key=lambda key: cost.Link.parse(key[0]).rate_bps):  # the slowest link first
        checked[key] = check_group(name, optimizer, machine_name, groups[key], published, transport, meetings)
    return [row for key in groups for row in checked[key]]


def check_group(name, optimizer, machine_name, group, published, transport, meetings):
    """check_table's rows of one link and layout."""
    link_name, hosts_cell = group[0]["link"], group[0]["hosts"]
    ranks, hosts = layout(hosts_cell)
    cluster = cost.Cluster(ranks, cost.Link.parse(link_name, FLAGS.latency_us * 1e-6), hosts, transport=transport)
    shapes = model_shapes(group[0]["model"])
    elements = sum(math.prod(s) for s in shapes)
    floor = next((r for r in group if r["method"] == "no_exchange"), None)
    fp32 = next((r for r in group if r["method"] == "horovod_fp32"), None)
    calibration = None
    if floor is not None:
        compute_s = number(floor["step ms"]) / 1e3
        if fp32 is not None and FLAGS.fit_link:  # the link as Horovod fp32's allreduce found it
            calibration = fp32
            # (ranks that outnumber the cores share them with the kernel's TCP: their link is slower, not their
            # meeting longer)
            most_sync_s = 0.0 if ranks > cores_of(machine_name) else meetings.get(hosts_cell, math.inf)
            cluster = fitted_cluster(cluster, shapes, compute_s, number(fp32["step ms"]) / 1e3, published,
                                     optimizer, most_sync_s)
            meetings.setdefault(hosts_cell, cluster.sync_s)
    else:  # Horovod fp32's row less its link time: the job as it runs today
        calibration = next(r for r in group if r["method"] == "horovod_fp32")
        compute_s = number(calibration["step ms"]) / 1e3 - cost.predict(
            "horovod_fp32", shapes, 0.0, cluster, published, optimizer).total_s
    machine = sharing_cores(published.scaled_to(compute_s, elements), ranks, machine_name)
    checked = []
    for row in group:
        if row["method"] == "no_exchange":
            continue
        measured = number(row["step ms"])
        entry = dict(table=name, machine=machine_name, optimizer=optimizer, link=link_name, hosts=hosts_cell,
                     model=row["model"], method=row["method"], measured_ms=measured,
                     accounted_bytes=number(row["accounted bytes/step/worker"]))
        resolved = resolve(row["method"])
        if resolved is None:
            checked.append({**entry, "status": "not modelled"})
            continue
        method, overrides, hierarchical, overlap = resolved
        step = cost.predict(method, shapes, compute_s, cluster, machine, optimizer, overrides, hierarchical, overlap)
        predicted = step.total_s * 1e3
        status = "calibration" if row is calibration else (
            "within" if abs(predicted / measured - 1) <= FLAGS.tolerance else "outside")
        checked.append({**entry, "status": status, "predicted_ms": predicted, "compute_ms": compute_s * 1e3,
                        "own_ms": step.own_s * 1e3, "link_ms": step.link_s * 1e3, "sync_ms": cluster.sync_s * 1e3,
                        "planned_bytes": step.bytes_per_rank, "error": predicted / measured - 1})
    return checked


def cores_of(machine_name):
    """The cores of a table's machine line ("2 CPUs (...)"); as many as any ranks where it names none."""
    found = re.match(r"(\d+) CPUs", machine_name)
    return int(found.group(1)) if found else math.inf


def sharing_cores(machine, ranks, machine_name):
    """The machine with its float16 sums where a table's `ranks` ranks shared the cores its machine line names
    ("2 CPUs (...)"): wire.py's hosts are network namespaces of one machine, and host_collectives.py measured one
    rank a core, so where more ranks than cores share them each rank's sums take ranks / cores as long. The
    loopback's rate stays: it was measured with every core busy moving the bytes (a transfer's copies are both
    ends'), and Horovod fp32's ring on 4 ranks of 2 cores ran at 4.8-6.7 Gbit/s, not half of it."""
    share = ranks / cores_of(machine_name)
    if share <= 1:
        return machine
    return dataclasses.replace(machine, host_collectives={
        t: dataclasses.replace(c, half_sum_per_element_s=c.half_sum_per_element_s * share)
        for t, c in machine.host_collectives.items()})


def fitted_cluster(cluster, shapes, compute_s, fp32_step_s, machine, optimizer, most_sync_s=math.inf):
    """The cluster as Horovod fp32's step shows it: its link at the shaped rate's TCP payload
    (netns.TCP_PAYLOAD_FRACTION), and what the step takes beyond its compute, its own costs and its link's time at
    that rate first the ranks' meeting once a step (`Cluster.sync_s`: on these 2-core machines the ranks' waiting
    for the slowest and Horovod's negotiation, most of a small model's exchanging step), up to `most_sync_s`, then
    a lower rate. check_table fits a layout's meeting on its slowest link, whose rate the kernel's TCP keeps (one
    stream: 956 Mbit/s of payload at 1gbit), and caps the faster links' by it: there the kernel's TCP through the
    veths costs the cores the ranks compute on, and carries less than the shaped rate. A step shorter than the
    payload rate allows gives the rate it shows (at most the shaped one) and no meeting."""
    payload = dataclasses.replace(cluster, link=dataclasses.replace(
        cluster.link, rate_bps=cluster.link.rate_bps * netns.TCP_PAYLOAD_FRACTION))
    step = cost.predict("horovod_fp32", shapes, compute_s, payload, machine, optimizer)
    rest = fp32_step_s - step.total_s
    sync = min(max(rest, 0.0), most_sync_s)
    bits = step.host_link_bytes * 8
    if sync == rest or bits == 0:
        return dataclasses.replace(payload, sync_s=max(sync, 0.0))
    # the rest of it the bytes' time at a rate of its own (the latency's and the stages' inside a host kept)
    bytes_s = bits / payload.link.rate_bps + rest - sync
    rate = min(cluster.link.rate_bps, bits / bytes_s) if bytes_s > 0 else cluster.link.rate_bps
    return dataclasses.replace(payload, link=dataclasses.replace(payload.link, rate_bps=rate), sync_s=sync)


def published_rows(text):
    """Every published wire table's rows, checked against the published one-rank costs."""
    for name, command, table in published_tables(text):
        optimizer = optimizer_of(command)
        yield from check_table(name, optimizer, machine_of(text, name), table, cost.published_cpu(optimizer),
                               launcher_of(command))


def same_run_rows(wire_json, overhead_json):
    """A wire.py JSON's rows checked against one-rank costs from an overhead.py JSON of the same machine and
    optimizer (a run of both in one session: what the model can do where its parts are measured alongside)."""
    overhead = results.load(overhead_json)
    optimizer = overhead[0]["optimizer"]
    model = overhead[0]["model"]
    overhead = [r for r in overhead if r["model"] == model]
    floor = next((r["step_ms"] for r in overhead if r["method"] == "no_exchange"), None)
    # (interleaved rows carry what they add to the floor's step of the same turn: the floor plus it)
    steps = {r["method"]: floor + r["added_ms"] if floor is not None and r.get("added_ms") is not None
             else r["step_ms"] for r in overhead}
    machine = cost.Machine.from_steps(f"{overhead_json} ({results.machine()})", model_shapes(model), steps, optimizer)
    rows = [{"link": r["rate"], "hosts": r["layout"], "model": r["model"], "method": r["method"],
             "step ms": str(r["step_ms"]), "accounted bytes/step/worker": str(r["accounted"])}
            for r in results.load(wire_json) if r["model"] == model]
    return check_table(f"{pathlib.Path(wire_json).stem} (same run)", optimizer, results.machine(), rows, machine)


def render(rows):
    predicted = [r for r in rows if r["status"] in ("within", "outside")]
    within = sum(r["status"] == "within" for r in predicted)
    summary = (f"{within} of {len(predicted)} predicted rows within {FLAGS.tolerance:.0%} of the measured step "
               f"({within / max(len(predicted), 1):.0%}); {sum(r['status'] == 'calibration' for r in rows)} "
               f"calibration rows (Horovod fp32's: the compute where a table has no floor, else the link's fit), "
               f"{sum(r['status'] == 'not modelled' for r in rows)} not modelled.")
    table = results.markdown_table(
        ["table", "link", "hosts", "method", "measured ms", "predicted ms", "error", "compute", "own", "link ms",
         "of which sync", "planned bytes / accounted"],
        [[r["table"], r["link"], r["hosts"], r["method"], f"{r['measured_ms']:,.1f}",
          f"{r['predicted_ms']:,.1f}" if "predicted_ms" in r else "-",
          f"{r['error']:+.0%}" if r["status"] in ("within", "outside") else r["status"],
          *(f"{r[k]:,.1f}" if k in r else "-" for k in ("compute_ms", "own_ms", "link_ms", "sync_ms")),
          f"{r['planned_bytes'] / r['accounted_bytes']:.3f}" if r.get("accounted_bytes") and "planned_bytes" in r
          else "-"] for r in rows])
    machines = sorted({f"`{r['table']}`: {r['machine']}" for r in rows})
    return "\n\n".join([summary, table, "The tables' machines: " + "; ".join(machines) + "."])


def publish_from(data):
    results.publish("cost_check_same_run" if FLAGS.same_run else "cost_check", render(data["rows"]), source=FLAGS.out,
                    doc=results.REPO / "docs" / "cost_model.md")


def main(argv):
    del argv
    if FLAGS.same_run:
        rows = [r for pair in FLAGS.same_run for r in same_run_rows(*pair.split(":"))]
    else:
        rows = list(published_rows(pathlib.Path(FLAGS.doc).read_text()))
    print(render(rows))
    data = dict(tolerance=FLAGS.tolerance, latency_us=FLAGS.latency_us, rows=rows)
    results.save(FLAGS.out, data)
    publish_from(data)


if __name__ == "__main__":
    app.run(results.run(main, publish_from))
