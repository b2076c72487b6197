"""The repository stands alone (issue 19, defect 15).

A fresh clone has no ``../shared``: every example and every data-dependent
command either runs, or fails with one line (exit 2) that names the missing data
set and where to get it. Each run here has ``$BEARSDK_DATA`` pointing at an
empty folder (which, once set, is the only place looked at) and its working
directory in a temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bearsdk.data import DATASETS, DataNotFoundError, data_dir, find_data_dir

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BEARSDK = [sys.executable, "-m", "bearsdk"]


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A working folder with a copy of the examples and no data anywhere it can see."""
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    (tmp_path / "empty").mkdir()
    return tmp_path


def run(clone: Path, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BEARSDK_SHARED")}
    env["BEARSDK_DATA"] = str(clone / "empty")
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, cwd=clone, env=env
    )


def assert_names_missing_data(proc: subprocess.CompletedProcess[str], dataset: str) -> None:
    """Exit 2, one line on stderr naming the data set, where it looked and its source."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    ds = DATASETS[dataset]
    assert f"data set {dataset!r}" in lines[0]
    assert "BEARSDK_DATA" in lines[0]
    assert ds.source.split()[0] in lines[0]  # the public URL


def example(name: str) -> str:
    return str(Path("examples") / name)


def test_the_examples_that_need_no_data_run(clone: Path) -> None:
    proc = run(clone, sys.executable, example("chat_service.py"), "--self-test")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run(
        clone,
        sys.executable,
        example("agent.py"),
        "--agents",
        "2",
        "--spread",
        "0.2",
        "--slowdown",
        "1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 agents, 8 model calls" in proc.stdout


def test_batch_eval_names_the_trace_and_its_source(clone: Path) -> None:
    proc = run(clone, sys.executable, example("batch_eval.py"), "--requests", "5")
    assert_names_missing_data(proc, "azure-llm-2023")
    # --data-dir takes precedence and is named as what was looked at.
    proc = run(
        clone, sys.executable, example("batch_eval.py"), "--data-dir", "nowhere", "--requests", "5"
    )
    assert_names_missing_data(proc, "azure-llm-2023")
    assert "nowhere (--data-dir)" in proc.stderr


def test_readme_demo_runs_without_the_data(clone: Path) -> None:
    proc = run(
        clone,
        *BEARSDK,
        "demo",
        "--rates",
        "4",
        "--policies",
        "bear",
        "--duration",
        "1",
        "--jobs",
        "1",
        "--no-plot",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bear " in proc.stdout


def test_simulate_examples(clone: Path) -> None:
    # The paper's setup draws its own workload: it runs.
    proc = run(
        clone,
        *BEARSDK,
        "simulate",
        "--config",
        example("simulate/estimators.toml"),
        "--requests",
        "30",
        "--seeds",
        "0",
        "--workers",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The real-data one says what it needs, from the environment or --data-dir.
    cfg = example("simulate/alpaca-azure.toml")
    argv = [*BEARSDK, "simulate", "--config", cfg, "--requests", "30", "--no-progress"]
    assert_names_missing_data(run(clone, *argv), "alpaca-eval")
    proc = run(clone, *argv, "--data-dir", "elsewhere")
    assert_names_missing_data(proc, "alpaca-eval")
    assert str(clone / "elsewhere") in proc.stderr


@pytest.mark.parametrize(
    ("argv", "dataset"),
    [
        (("calibrate", "--vidur-dense"), "vidur-profiling"),
        (("calibrate", "--derive-profiles", "profiles.toml"), "vidur-profiling"),
        (("train", "--synthetic", "--out", "x.bearpred"), "vidur-traces"),
    ],
)
def test_data_dependent_commands_name_the_data(
    clone: Path, argv: tuple[str, ...], dataset: str
) -> None:
    assert_names_missing_data(run(clone, *BEARSDK, *argv), dataset)
    assert not (clone / argv[-1]).exists()


def test_the_emulator_table_derivation_names_the_data(clone: Path) -> None:
    argv = (sys.executable, "-m", "bearsdk.emulator.derive", "--out", "derived.py")
    assert_names_missing_data(run(clone, *argv), "vidur-profiling")
    assert not (clone / "derived.py").exists()


# -- the resolver --------------------------------------------------------------------


def test_data_dir_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BEARSDK_DATA", "BEARSDK_SHARED_DATA", "BEARSDK_SHARED"):
        monkeypatch.delenv(var, raising=False)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c / "data"):
        (d / "mooncake").mkdir(parents=True)
    monkeypatch.setenv("BEARSDK_SHARED", str(c))
    assert data_dir(None, "mooncake") == c / "data"
    monkeypatch.setenv("BEARSDK_SHARED_DATA", str(b))
    assert data_dir(None, "mooncake") == b
    monkeypatch.setenv("BEARSDK_DATA", str(a))
    assert data_dir(None, "mooncake") == a
    assert find_data_dir() == a
    assert data_dir(b, "mooncake") == b  # --data-dir wins
    # Once one place is named, no other is looked at.
    with pytest.raises(DataNotFoundError) as err:
        data_dir(None, "alpaca-eval")
    assert err.value.looked == (f"{a} ($BEARSDK_DATA)",)
    assert err.value.dataset is DATASETS["alpaca-eval"]
    assert isinstance(err.value, FileNotFoundError)
    msg = str(err.value)
    assert "\n" not in msg
    assert "https://github.com/tatsu-lab/alpaca_eval" in msg
    assert "CC BY-NC" in msg


def test_every_data_set_names_a_public_source() -> None:
    for ds in DATASETS.values():
        assert ds.source.startswith("https://"), ds
        assert ds.licence


# -- the docs --------------------------------------------------------------------


def _published() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".toml")),
    ]


def _sources() -> list[Path]:
    return [
        p
        for top in ("bearsdk", "cext", "schedulers", "tests")
        for p in sorted((REPO / top).rglob("*"))
        if p.suffix in (".py", ".pyx", ".pxd", ".toml", ".md") and "data" not in p.parts
    ]


def _hits(paths: list[Path], bad: re.Pattern[str]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in paths
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if bad.search(line)
    ]


MACHINE_PATH = r"(?<![\w.])/(?:work|root|home|Users)/"


def test_docs_and_examples_point_only_inside_the_repository() -> None:
    hits = _hits(_published(), re.compile(r"\.\./shared|" + MACHINE_PATH))
    assert not hits, "\n".join(hits)


def test_no_source_holds_a_path_of_a_machine() -> None:
    hits = _hits(_sources(), re.compile(MACHINE_PATH))
    assert not hits, "\n".join(hits)


def test_the_data_stay_out_of_the_package() -> None:
    for pattern in ("preference_*.csv", "output_length_*.csv", "AzureLLMInferenceTrace_*.csv"):
        assert not list((REPO / "bearsdk").rglob(pattern)), pattern
