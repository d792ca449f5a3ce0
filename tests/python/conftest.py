import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def peer():
    """Start peer.py in a child process; every child is killed at the end."""
    procs = []

    def start(*args):
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "peer.py"), *map(str, args)],
                             stdout=subprocess.PIPE, env=os.environ.copy())
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
