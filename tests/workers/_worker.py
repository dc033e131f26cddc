"""What every test worker shares: flags, horovod start-up and the per-rank result file."""
import json
import os
import pathlib

from absl import flags

flags.DEFINE_string("out_dir", None, "Where each rank writes rank<N>.json.")
FLAGS = flags.FLAGS


def report(hvd, **result):
    """Writes this rank's result for tests/hvdrun.run_ranks."""
    path = pathlib.Path(FLAGS.out_dir) / f"rank{hvd.rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
