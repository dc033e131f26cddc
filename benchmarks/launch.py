"""What the multi-rank benchmarks share: the MLP they time, and starting their ranks.

A benchmark script runs itself under horovodrun with --role=worker; rank 0
writes its figures to the JSON file named by --result, which the launcher
returns.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def mlp(keras, layers):
    """A ReLU MLP with these layer widths (input first, logits last)."""
    return keras.Sequential([keras.layers.Input((layers[0],))] + [
        keras.layers.Dense(units, activation="relu" if i < len(layers) - 2 else None)
        for i, units in enumerate(layers[1:])])


def run_worker(script, ranks, flags, threads_per_rank=1, timeout=900):
    """Runs `script --role=worker <flags> --result=...` on `ranks` local Gloo ranks; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        horovodrun = pathlib.Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable,
               str(script), "--role=worker", f"--result={result}", *flags]
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(threads_per_rank), TF_NUM_INTEROP_THREADS="1")
        subprocess.run(cmd, check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        return json.loads(result.read_text())
