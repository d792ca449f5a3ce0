"""docs/from-tensordict.md has the parts the migration needs, and every
tdpipe name its mapping and option list give exists; docs/python.md says
how to go across hosts. A renamed call or option fails here, not in a
reader's hands."""
import inspect
import os
import re

import pytest

import tdpipe

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")


def read(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


def section(text, heading):
    m = re.search(r"^## %s\n(.*?)(?=^## |\Z)" % re.escape(heading), text, re.M | re.S)
    assert m, "no section '## %s'" % heading
    return m.group(1)


def test_migration_page_has_its_four_parts():
    doc = read("from-tensordict.md")
    mapping = section(doc, "The mapping")
    for call in ("TensorDictPipe.connect", "TensorDictPipe.listen", "pipe.asend(td)",
                 "pipe.arecv(td)", "arecv(device=", "TensorDictServer", "async for",
                 "aclose", 'td["info", "reward"]', "td.batch_size", "consolidate"):
        assert call in mapping, call
    assert "td.send(dst=pipe)" in section(doc, "What has no equivalent")
    talk = section(doc, "Can a tensordict peer and a tdpipe peer talk?")
    assert talk.lstrip().startswith("**No.**")
    serve = section(doc, "`serve(on_connect)` and `Server`")
    assert "async def handle_client(pipe)" in serve and "def handler(req" in serve


def test_every_tdpipe_name_in_the_mapping_exists():
    doc = read("from-tensordict.md")
    rows = [ln.split("|")[2] for ln in section(doc, "The mapping").splitlines()
            if ln.startswith("| ") and not ln.startswith("| tensordict")]
    owners = {"tdpipe": tdpipe, "pipe": tdpipe.Pipe, "lst": tdpipe.Listener,
              "msg": tdpipe.Message}
    seen = 0
    for cell in rows:
        for owner, name in re.findall(r"\b(tdpipe|pipe|lst|msg)\.([A-Za-z_]\w*)", cell):
            assert hasattr(owners[owner], name), "%s.%s" % (owner, name)
            seen += 1
    assert seen >= 20
    opts = re.search(r"Options tensordict does not have.*?\n\n", doc, re.S).group(0)
    for opt in re.findall(r"`(\w+)`", opts):
        if opt in ("connect", "listen"):
            continue
        assert opt in tdpipe._OPTS or opt in inspect.signature(tdpipe.connect).parameters, opt


def test_python_md_says_how_to_go_across_hosts():
    across = section(read("python.md"), "Across hosts")
    for what in ("tdpipe.listen(None, 5555)", "UCX_NET_DEVICES", "`ucx` plane", "`shm` plane",
                 "secret="):
        assert what in across, what
