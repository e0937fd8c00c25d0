"""The entry points' garbage collector (convit_scale/entry.py): a rank holds collections off while it imports, then
collects again for the rest of its life; the command line as a library call leaves the caller's collector alone."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from support import PY, REPO

from convit_scale import entry


def test_a_rank_collects_again_after_its_imports():
    """``python -m convit_scale.train``: by the time ``main`` runs, the imports' objects are frozen and the collector
    is on (left off, a run of days would keep every reference cycle it ever made)."""
    code = ("import gc, json, sys\n"
            "import convit_scale.train.__main__ as m\n"
            "assert gc.isenabled() and gc.get_freeze_count() == 0, 'a plain import must not touch the collector'\n"
            "import argparse\n"
            "real = argparse.ArgumentParser.parse_args\n"
            "def parse_args(self, *a, **k):\n"
            "    print(json.dumps({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count()}), flush=True)\n"
            "    return real(self, *a, **k)\n"
            "argparse.ArgumentParser.parse_args = parse_args\n"
            "import runpy\n"
            "sys.argv = ['convit_scale.train', '--help']\n"
            "runpy.run_module('convit_scale.train', run_name='__main__', alter_sys=True)\n")
    res = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    state = json.loads(res.stdout.splitlines()[0])
    assert state["enabled"] and state["frozen"] > 100_000  # torch's and timm's objects, frozen


def test_the_command_line_freezes_only_as_the_process_entry(monkeypatch, capsys):
    from convit_scale.cli import main

    before = gc.get_freeze_count()
    assert main(["models"]) == 0  # a library call: the caller's collector as it was
    assert gc.get_freeze_count() == before and gc.isenabled()
    monkeypatch.setattr(sys, "argv", ["convit-scale", "models"])
    try:
        assert main() == 0  # the process's entry point: what is alive is frozen for its exit
        assert gc.get_freeze_count() > before and gc.isenabled()
    finally:
        gc.unfreeze()
    capsys.readouterr()


def test_importing_then_imported_leaves_the_collector_on():
    was = gc.isenabled()
    try:
        entry.importing()
        assert not gc.isenabled()
        entry.imported()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert entry.exiting(3) == 3
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()
