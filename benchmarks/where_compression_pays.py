"""Where compression pays on GPU clusters: the cost model's predicted step per method, 8 to 1024 GPUs.

    .venv/bin/python benchmarks/where_compression_pays.py      # the table and plot in docs/cost_model.md

Measures nothing: every figure is hvd_compress.cost's prediction under these assumptions (also printed above the table):
- GPUs: NVIDIA H100, 8 a host joined by NVLink (--intra_host_link, 3,600 Gbit/s: 450 GB/s), each host one link of
  --links to the others, --latency_us a message round;
- compute: a transformer's step, 6 N x --tokens_per_gpu FLOPs at --utilisation of 989 TFLOP/s (bfloat16, dense);
  the same tokens per GPU at every size of cluster (weak scaling);
- the models: --models parameters, their tensors stand-in matrices (cost.model_shapes) as wide as the model's
  hidden size (768 at 125M, 1,024 at 350M, 2,048 at 1.3B, 4,096 at 7B);
- own costs: the GPU kernels' timings on an H100 (cost.H100; TensorFlow's glue around them not counted), 50 us a
  collective;
- Horovod fp16 (NCCL's ring: a host's link carries 2 (n-1)/n of the 2-byte gradient) against hvd_compress's methods
  with hierarchical=True (full precision over NVLink, compressed between hosts), under AdamW: 1-bit Adam (its Adam
  defaults) is the low-risk method; DiLoCo in 4 bits syncs every 20 steps, flat (cost.runs_flat), and loses
  accuracy (docs/benchmarks.md).
A cell's speed-up is Horovod fp16's predicted step over the method's.
"""
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import results  # noqa: E402
from hvd_compress import cost  # noqa: E402

flags.DEFINE_list("models", ["125m", "350m", "1.3b", "7b"], "Parameter counts.")
flags.DEFINE_list("gpus", ["8", "64", "256", "1024"], "GPUs in all (8 a host).")
flags.DEFINE_list("links", ["10gbit", "25gbit", "100gbit", "400gbit"], "A host's link rate.")
flags.DEFINE_list("methods", ["horovod_fp16", "onebit", "quantize4", "powersgd", "diloco_q4"], "Methods compared.")
flags.DEFINE_integer("tokens_per_gpu", 16384, "Tokens a GPU trains on per step (e.g. 8 sequences of 2,048).")
flags.DEFINE_float("utilisation", 0.4, "Model FLOPs utilisation of the H100's 989 TFLOP/s.")
flags.DEFINE_float("latency_us", 10.0, "A message round between hosts, microseconds.")
flags.DEFINE_string("intra_host_link", "3600gbit", "Between the GPUs of a host (NVLink).")
flags.DEFINE_string("out", "results/where_compression_pays.json", "The rows' JSON.")
FLAGS = flags.FLAGS

GPUS_PER_HOST = 8
WIDTH = {125_000_000: 768, 350_000_000: 1024, 1_300_000_000: 2048, 7_000_000_000: 4096}


def count(text):
    from hvd_compress.advise import parse_count
    return parse_count(text)


def predict_rows():
    rows = []
    for model in FLAGS.models:
        parameters = count(model)
        shapes = cost.model_shapes(parameters, WIDTH.get(parameters, 4096))
        compute_s = cost.transformer_compute_s(parameters, FLAGS.tokens_per_gpu, utilisation=FLAGS.utilisation)
        for gpus in map(int, FLAGS.gpus):
            for link in FLAGS.links:
                cluster = cost.Cluster(gpus, cost.Link.parse(link, FLAGS.latency_us * 1e-6),
                                       max(1, gpus // GPUS_PER_HOST),
                                       cost.Link.parse(FLAGS.intra_host_link).rate_bps, transport="nccl")
                steps = {m: cost.predict(m, shapes, compute_s, cluster, cost.H100, "adamw", hierarchical=True)
                         for m in FLAGS.methods}
                rows.append(dict(model=model, parameters=parameters, gpus=gpus, link=link, compute_ms=compute_s * 1e3,
                                 step_ms={m: s.total_s * 1e3 for m, s in steps.items()},
                                 host_link_bytes={m: s.host_link_bytes for m, s in steps.items()}))
    return rows


def render(data):
    methods = data["methods"]
    header = ["model", "GPUs", "link", "compute ms", *(f"{m} ms" for m in methods),
              *(f"{m} vs fp16" for m in methods if m != "horovod_fp16")]
    body = []
    for r in data["rows"]:
        fp16 = r["step_ms"]["horovod_fp16"]
        body.append([r["model"], r["gpus"], r["link"], f"{r['compute_ms']:,.0f}",
                     *(f"{r['step_ms'][m]:,.0f}" for m in methods),
                     *(f"{fp16 / r['step_ms'][m]:.2f}x" for m in methods if m != "horovod_fp16")])
    assumptions = (f"H100s, {GPUS_PER_HOST} a host over NVLink ({data['intra_host_link']}); compute 6 N x "
                   f"{data['tokens_per_gpu']:,} tokens a GPU at {data['utilisation']:.0%} of 989 TFLOP/s; "
                   f"{data['latency_us']:g} us a message round between hosts; own costs: {cost.H100.name}; "
                   "hvd_compress's methods hierarchical, DiLoCo flat (it has no hierarchical form), under AdamW.")
    return assumptions + "\n\n" + results.markdown_table(header, body)


def plot(data, path):
    fig, axes = results.figure(len(FLAGS.models))
    for ax, model in zip(axes, FLAGS.models):
        for gpus in map(int, FLAGS.gpus):
            rows = [r for r in data["rows"] if r["model"] == model and r["gpus"] == gpus]
            rates = [cost.Link.parse(r["link"]).rate_bps / 1e9 for r in rows]
            ax.plot(rates, [r["step_ms"]["horovod_fp16"] / r["step_ms"]["onebit"] for r in rows], marker="o",
                    label=f"{gpus} GPUs")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("a host's link, Gbit/s")
        ax.set_title(f"{model}: 1-bit Adam vs Horovod fp16")
    axes[0].set_ylabel("predicted speed-up")
    axes[0].legend()
    results.save_figure(fig, path)


def publish_from(data):
    results.publish("where_compression_pays", render(data), source=FLAGS.out, doc=results.REPO / "docs" / "cost_model.md")
    plot(data, results.REPO / "docs" / "img" / "where_compression_pays.png")


def main(argv):
    del argv
    data = dict(methods=FLAGS.methods, tokens_per_gpu=FLAGS.tokens_per_gpu, utilisation=FLAGS.utilisation,
                latency_us=FLAGS.latency_us, intra_host_link=FLAGS.intra_host_link, rows=predict_rows())
    print(render(data))
    results.save(FLAGS.out, data)
    publish_from(data)


if __name__ == "__main__":
    app.run(results.run(main, publish_from))
