"""bench/python_asend.py in short: prints sync send against asyncio asend
(plain dict, consolidated buffer) in msgs/s with the library's allocations
per message. Rates are printed, not asserted (a shared machine makes them
vary); the allocations are asserted: none per message on any send path."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import python_asend  # noqa: E402


def test_send_paths_rates_and_allocations(capsys):
    rows = python_asend.run([1000, 1000000, 3000000], seconds=0.2, repeats=1)
    with capsys.disabled():
        print("\n" + python_asend.table(rows))
    assert [r[1] for r in rows] == list(python_asend.WAYS) * 3
    for size, way, rate, host, small, _plane in rows:
        assert rate > 0
        assert host == 0, (size, way, host)  # no buffer allocated per message
        assert small == 0, (size, way, small)  # nor any small object of the library's
