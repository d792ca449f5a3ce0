"""`tdpipe bench` labels the throughput of loaned slots a hand-off rate (no
byte is copied) and shows the data rate of a plain send beside it, in the
table, the JSON and the progress lines; a --no-loan run is a data rate."""
import json
import os
import subprocess

import pytest

import tdpipe

CLI = os.path.normpath(os.path.join(os.path.dirname(tdpipe.__file__), "..", "..", "tools",
                                    "tdpipe"))


def bench(tmp_path, *extra):
    out = tmp_path / "b.json"
    r = subprocess.run([CLI, "bench", "--sizes", "1M", "--rounds", "20", "--json", str(out)] +
                       list(extra), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads(out.read_text())


@pytest.mark.skipif(not os.access(CLI, os.X_OK), reason="no tdpipe CLI in this build tree")
def test_loaned_throughput_is_labelled_handoff_with_plain_send_beside(tmp_path):
    r, js = bench(tmp_path, "--plane", "shm")
    res = js["results"][0]
    assert js["config"]["loan"] is True
    assert res["throughput_is"] == "handoff"
    assert res["plain_send_Bps"]["median"] > 0 and res["plain_send_Bps"]["repeats"] == 3
    head = [ln for ln in r.stdout.splitlines() if ln.startswith("size")][0]
    assert "hand-off" in head and "plain send" in head and "throughput" not in head
    assert "not a data rate" in r.stdout
    assert "hand-off" in r.stderr and "plain send" in r.stderr


@pytest.mark.skipif(not os.access(CLI, os.X_OK), reason="no tdpipe CLI in this build tree")
def test_plain_throughput_is_a_data_rate(tmp_path):
    r, js = bench(tmp_path, "--no-loan")
    res = js["results"][0]
    assert res["throughput_is"] == "data" and "plain_send_Bps" not in res
    head = [ln for ln in r.stdout.splitlines() if ln.startswith("size")][0]
    assert "throughput" in head and "hand-off" not in head


@pytest.mark.skipif(not os.access(CLI, os.X_OK), reason="no tdpipe CLI in this build tree")
@pytest.mark.parametrize("loan", [True, False])
def test_plot_labels_handoff_and_draws_the_data_rate(tmp_path, loan):
    """--plot: the gnuplot script (captured by a gnuplot that writes its
    input to the plot file) names the loaned rate a hand-off rate, not a
    data rate, and draws the plain send's data rate beside it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gnuplot").write_text("#!/bin/sh\nexec cat\n")
    (fake / "gnuplot").chmod(0o755)
    env = dict(os.environ, PATH="%s:%s" % (fake, os.environ.get("PATH", "")))
    plot = tmp_path / "p.svg"
    r = subprocess.run([CLI, "bench", "--sizes", "1M", "--rounds", "20", "--plot", str(plot)] +
                       ([] if loan else ["--no-loan"]), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    script = plot.read_text()
    if loan:
        assert "'plain send (data rate, one copy)'" in script
        assert "'hand-off rate, loaned slots (no copy: not a data rate)'" in script
        assert "throughput" not in script
    else:
        assert "throughput (GB/s)" in script and "hand-off" not in script
