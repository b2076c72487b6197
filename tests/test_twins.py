"""One twin convention: one reader of BEARSDK_NO_EXTENSIONS, one report of what is loaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bearsdk import _twins

PACKAGE = Path(_twins.__file__).resolve().parent


def test_one_module_reads_the_switch() -> None:
    readers = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if re.search(r"environ[^\n]*BEARSDK_NO_EXTENSIONS", p.read_text(encoding="utf-8"))
    ]
    assert readers == ["_twins.py"]


@pytest.mark.parametrize("flag", ["", "1"])
def test_every_selector_follows_the_switch(flag: str) -> None:
    # Each selector module's own IMPLEMENTATION must be what _twins.loaded() reports.
    code = (
        "import json\n"
        "from bearsdk import _twins, snapshot\n"
        "from bearsdk.io import shm\n"
        "from bearsdk.predictors import _impl\n"
        "from bearsdk.replay import IMPLEMENTATION as replay\n"
        "from bearsdk.vllm import publisher\n"
        "from bearsdk.kvevents import index\n"
        "from bearsdk.prompts import pretok\n"
        "print(json.dumps({'loaded': _twins.loaded(), 'actual': {'replay': replay,"
        " 'snapshot': 'python' if snapshot._scan is None else 'cython',"
        " 'features': _impl.IMPLEMENTATION, 'shm': shm.IMPLEMENTATION,"
        " 'vllm-publisher': publisher.IMPLEMENTATION,"
        " 'prefix-index': index.IMPLEMENTATION, 'pretokenizer': pretok.IMPLEMENTATION,"
        " 'prefix-cache': 'python' if snapshot._validate_pc is None else 'cython'}}))\n"
    )
    env = {**os.environ, "BEARSDK_NO_EXTENSIONS": flag}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    got = json.loads(out)
    assert got["loaded"] == got["actual"]
    assert set(got["loaded"]) == set(_twins.PAIRS)
    if flag:
        assert set(got["loaded"].values()) == {"python"}


def test_version_reports_every_pair() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bearsdk", "--version"], capture_output=True, text=True, check=True
    ).stdout
    out = " ".join(out.split())  # argparse wraps the version line
    for pair, impl in _twins.loaded().items():
        assert f"{pair}: {impl}" in out
