"""benchmarks/wire.py on a real shaped link: 2 ranks in their own network namespaces at 1 Gbit/s.

Needs root (network namespaces, veths, tc); skipped, with the reason, where
that is missing. The kernel's veth counters must agree with the exchanges' own
byte accounting, and the benchmark must leave no namespace behind.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.append(str(BENCHMARKS))
import netns  # noqa: E402


def wire_namespaces():
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(netns.PREFIX)]


@pytest.mark.timeout(300)
def test_veth_bytes_match_the_accounting_and_nothing_is_left_behind(tmp_path):
    reason = netns.check_rights()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "wire.json"
    cmd = [sys.executable, str(BENCHMARKS / "wire.py"), "--rates=1gbit", "--ranks=2", "--models=mlp4m",
           "--methods=horovod_fp32,onebit,fp16,quantize8", "--steps=5", "--warmup=2", "--idle_s=1", "--timeout=200",
           "--inter_op_threads=2", f"--out={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher removes its network on SIGTERM
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"wire.py timed out after 240s.\n$ {' '.join(cmd)}\n{output}", pytrace=False)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{output}"
    assert wire_namespaces() == []

    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"horovod_fp32", "onebit", "fp16", "quantize8"}
    for method, r in rows.items():
        assert r["ranks"] == 2 and [p["hostname"] for p in r["per_rank"]] == ["hc-ns0", "hc-ns1"]
        assert [p["inter_op_threads"] for p in r["per_rank"]] == [2, 2]
        # TCP payload on the veth (headers taken off per packet) vs what the exchange says it sends, less
        # Horovod's own control traffic (its idle rate times the step time): the exchange does not send it,
        # and slower steps carry more of it. On onebit's 0.5 MB a step it was +2.6% on a quiet machine,
        # and the whole excess over the accounting reached +6.8% on a loaded 2-core CI machine.
        unexplained = r["wire_vs_accounted"] - r["control_vs_accounted_est"]
        assert abs(unexplained) < 0.05, (method, r["wire_vs_accounted"], r["control_vs_accounted_est"], output)
    fp32 = rows["horovod_fp32"]["accounted"]
    assert fp32 >= 20 * rows["onebit"]["accounted"]
    assert rows["fp16"]["accounted"] == fp32 / 2  # its alltoalls move a ring's bytes
    assert fp32 / 3.8 > rows["quantize8"]["accounted"] > fp32 / 4  # 8-bit codes, a scale and offset per 256
