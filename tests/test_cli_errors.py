"""Every ``bearsdk`` command fails cleanly (issue 19: defects 11, 12, 17 and the CLI acceptance).

Each command, run as a user would (a subprocess), given a missing file, a bad
value or an unwritable output exits with status 2 and one line
``bearsdk CMD: error: ...`` on standard error, and given Ctrl-C (SIGINT to its
whole process group, as a terminal sends it, once the command said it started)
exits with 130 and one line, never a traceback.

The error cases are quick (they fail before any work): they run concurrently in
one fixture, each test then checks its own result.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# What is checked is the CLI's handling (before any work, or of Ctrl-C),
# whichever twins the commands run.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "bearsdk" / "schedulers" / "specs"

SNAP: dict[str, Any] = {
    "schema": "bear.snapshot/1",
    "instance": "i0",
    "seq": 1,
    "time": 0.0,
    "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 500},
    "requests": [
        {
            "id": "r1",
            "state": "running",
            "prompt_tokens": 700,
            "computed_tokens": 512,
            "output_tokens": 0,
            "max_tokens": 256,
            "output_len": 40,
        },
        {
            "id": "r2",
            "state": "running",
            "prompt_tokens": 90,
            "computed_tokens": 90,
            "output_tokens": 3,
            "max_tokens": 64,
            "output_len": 41,
        },
    ],
}

CASE: dict[str, Any] = {
    "case_id": "ok",
    "scheduler": "vllm-v1",
    "params": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "num_gpu_blocks": 1000},
    "snapshot": SNAP,
    "new": {"prompt_tokens": 300, "output_len": 5},
    "batch_time": [0.004, 2.0e-5, 4.0e-8, 1.0e-10],
}

SIM = """
[simulation]
name = "tiny"
requests = {requests}
seeds = [3]

[[pool]]
name = "small"
model = "Qwen/Qwen3-0.6B"
engine = "qwen3-0.6b-h100"

[workload]
unique_prompts = 20

[policies]
bear = {{}}
round-robin = {{}}
shortest-queue = {{}}

[[sweep]]
name = "rates"
rates = [4, 6, 8, 10]
"""

MISSING = "/nonexistent-bearsdk-dir/x"
"""A path whose folder does not exist (never created by anything)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "snap.json").write_text(json.dumps(SNAP))
    (d / "good.jsonl").write_text(json.dumps(CASE) + "\n")
    (d / "garbage.jsonl").write_text("not json\n[1, 2]\n")
    (d / "mixed.jsonl").write_text(
        json.dumps(CASE) + "\n" + json.dumps({**CASE, "case_id": "bad", "new": {}}) + "\n"
    )
    (d / "tiny.toml").write_text(SIM.format(requests=40))
    (d / "long.toml").write_text(SIM.format(requests=3000))
    spec = (SPECS / "vllm-v1.toml").read_text().replace('name = "vllm-v1"', 'name = "mine"')
    (d / "mine.toml").write_text(spec)
    (d / "bad.toml").write_text("[simulation\n")
    (d / "latin1.toml").write_bytes(b"[simulation]\nname = 'caf\xe9'\n")
    (d / "batches.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "schema": "bear.batch/1",
                    "duration_s": 0.004 + 2e-5 * (64 * i),
                    "prefill_tokens": 64 * i,
                    "decode_tokens": i,
                    "decode_context": 100 * i,
                    "prefill_attention": 0,
                }
            )
            + "\n"
            for i in range(1, 40)
        )
    )
    return d


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _bearsdk(*args: str) -> list[str]:
    return [sys.executable, "-m", "bearsdk", *args]


# -- error cases: (id, argv, part of the message) -----------------------------------
# argv may use {d} for the fixture folder.
ERROR_CASES: list[tuple[str, list[str], str]] = [
    # replay
    ("replay-missing-cases", ["replay", "--cases", "{d}/nope.jsonl"], "nope.jsonl"),
    (
        "replay-missing-snapshot",
        ["replay", "--snapshot", "{d}/nope.json", "--prompt-tokens", "10"],
        "nope.json",
    ),
    (
        "replay-prompt-tokens-0",
        ["replay", "--snapshot", "{d}/snap.json", "--prompt-tokens", "0"],
        "--prompt-tokens",
    ),
    (
        "replay-bad-snapshot",
        ["replay", "--snapshot", "{d}/garbage.jsonl", "--prompt-tokens", "10"],
        "snapshot",
    ),
    (
        "replay-missing-scheduler-file",
        [
            "replay",
            "--snapshot",
            "{d}/snap.json",
            "--prompt-tokens",
            "10",
            "--scheduler",
            "{d}/nope.toml",
        ],
        "nope.toml",
    ),
    (
        "replay-mean-output-len-0",
        ["replay", "--cases", "{d}/good.jsonl", "--mean-output-len", "0"],
        "--mean-output-len",
    ),
    # simulate
    ("simulate-missing-config", ["simulate", "--config", "{d}/nope.toml"], "nope.toml"),
    ("simulate-bad-config", ["simulate", "--config", "{d}/bad.toml"], "bad.toml"),
    ("simulate-config-not-utf8", ["simulate", "--config", "{d}/latin1.toml"], "not UTF-8"),
    (
        "simulate-requests-0",
        ["simulate", "--config", "{d}/tiny.toml", "--requests", "0"],
        "--requests",
    ),
    (
        "simulate-workers-0",
        ["simulate", "--config", "{d}/tiny.toml", "--workers", "0"],
        "--workers",
    ),
    (
        "simulate-out-unwritable",
        ["simulate", "--config", "{d}/tiny.toml", "--out", MISSING + "/x.json"],
        "nonexistent-bearsdk-dir",
    ),
    (
        "simulate-plots-unwritable",
        ["simulate", "--config", "{d}/tiny.toml", "--plots", "/proc/nope"],
        "/proc",
    ),
    # emulate
    ("emulate-missing-scheduler-file", ["emulate", "--scheduler", "{d}/nope.toml"], "nope.toml"),
    ("emulate-time-scale-0", ["emulate", "--time-scale", "0"], "--time-scale"),
    ("emulate-port-negative", ["emulate", "--port", "-1"], "--port"),
    ("emulate-unknown-profile", ["emulate", "--profile", "nope"], "nope"),
    ("emulate-port-in-use", ["emulate", "--port", "{port}"], "in use"),
    # calibrate
    ("calibrate-missing-batches", ["calibrate", "--batches", "{d}/nope.jsonl"], "nope.jsonl"),
    ("calibrate-missing-csv", ["calibrate", "--vidur-dense", "{d}/nope.csv"], "nope.csv"),
    ("calibrate-not-a-vidur-csv", ["calibrate", "--vidur-dense", "{d}/good.jsonl"], "Vidur"),
    ("calibrate-batches-not-utf8", ["calibrate", "--batches", "{d}/latin1.toml"], "not UTF-8"),
    (
        "calibrate-huber-delta-0",
        ["calibrate", "--batches", "{d}/batches.jsonl", "--huber-delta", "0"],
        "--huber-delta",
    ),
    (
        "calibrate-plot-unwritable",
        ["calibrate", "--batches", "{d}/batches.jsonl", "--plot", MISSING + "/p.png"],
        "nonexistent-bearsdk-dir",
    ),
    (
        "calibrate-derive-unwritable",
        ["calibrate", "--derive-profiles", MISSING + "/p.toml"],
        "nonexistent-bearsdk-dir",
    ),
    # train
    ("train-missing-data", ["train", "--data", "{d}/nope.jsonl", "--out", "{d}/m"], "nope.jsonl"),
    (
        "train-out-unwritable",
        ["train", "--data", "{d}/good.jsonl", "--out", "/proc/nope/m"],
        "/proc",
    ),
    (
        "train-prompts-per-task-0",
        ["train", "--synthetic", "--out", "{d}/m", "--prompts-per-task", "0"],
        "--prompts-per-task",
    ),
    # bench
    ("bench-emulator-rate-0", ["bench", "emulator", "--rate", "0"], "--rate"),
    ("bench-emulator-duration-nan", ["bench", "emulator", "--duration", "nan"], "--duration"),
    ("bench-emulator-unknown-profile", ["bench", "emulator", "--profiles", "nope"], "nope"),
    ("bench-router-rate-0", ["bench", "router", "--rate", "0"], "--rate"),
    ("bench-router-rounds-0", ["bench", "router", "--rounds", "0"], "--rounds"),
    ("bench-simulate-requests-0", ["bench", "simulate", "--requests", "0"], "--requests"),
    ("bench-simulate-rate-0", ["bench", "simulate", "--rate", "0"], "--rate"),
    ("bench-replay-rounds-0", ["bench", "replay", "--rounds", "0"], "--rounds"),
    ("bench-snapshots-rounds-0", ["bench", "snapshots", "--rounds", "0"], "--rounds"),
    ("bench-snapshots-rate-0", ["bench", "snapshots", "--rate", "0"], "--rate"),
    ("bench-estimators-rounds-0", ["bench", "estimators", "--rounds", "0"], "--rounds"),
    ("bench-staleness-requests-0", ["bench", "staleness", "--requests", "0"], "--requests"),
    ("bench-replicas-rate-0", ["bench", "replicas", "--rate", "0"], "--rate"),
    ("bench-replicas-replicas-0", ["bench", "replicas", "--replicas", "0"], "--replicas"),
    ("bench-predictors-models-0", ["bench", "predictors", "--models", "0"], "--models"),
    (
        "bench-predictors-missing-alpaca",
        ["bench", "predictors", "--skip-speed", "--alpaca-dir", "{d}/nope"],
        "nope",
    ),
    # demo
    ("demo-duration-0", ["demo", "--duration", "0"], "--duration"),
    ("demo-rates-0", ["demo", "--rates", "0"], "rate"),
    ("demo-plot-unwritable", ["demo", "--plot", MISSING + "/x.svg"], "nonexistent-bearsdk-dir"),
    # the parser itself
    ("unknown-command", ["nope"], "nope"),
    ("unknown-option", ["replay", "--cases", "{d}/good.jsonl", "--nope"], "--nope"),
]


def _run_error_case(argv: list[str], d: Path, port: int = 0) -> subprocess.CompletedProcess[str]:
    args = [a.replace("{d}", str(d)).replace("{port}", str(port)) for a in argv]
    return subprocess.run(
        _bearsdk(*args),
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=d,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def error_results(
    files: Path, busy_port: int, request: pytest.FixtureRequest
) -> dict[str, subprocess.CompletedProcess[str]]:
    # Only the cases this session selected (`-k`), all at once.
    wanted = {
        item.callspec.params["cid"]
        for item in request.session.items
        if hasattr(item, "callspec") and "cid" in item.callspec.params
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            cid: pool.submit(_run_error_case, argv, files, busy_port)
            for cid, argv, _ in ERROR_CASES
            if cid in wanted
        }
        return {cid: f.result() for cid, f in futures.items()}


def _one_error_line(res: subprocess.CompletedProcess[str], prefix: str) -> str:
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("cid", "argv", "needle"), [pytest.param(*c, id=c[0]) for c in ERROR_CASES]
)
def test_a_bad_input_is_one_line_and_exit_2(
    cid: str,
    argv: list[str],
    needle: str,
    error_results: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    res = error_results[cid]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    words = [w for w in argv[:2] if not w.startswith("-") and "{" not in w]
    prefix = "bearsdk " + " ".join(words[: 2 if words[0] == "bench" else 1])
    if cid == "unknown-command":
        prefix = "bearsdk: error:"
    line = _one_error_line(res, prefix)
    assert needle in line
    assert len(line) < 1000


def test_replay_cases_with_bad_lines_exit_2_and_name_the_line(files: Path) -> None:
    res = _run_error_case(["replay", "--cases", "{d}/mixed.jsonl"], files)
    assert res.returncode == 2
    good, bad = res.stdout.splitlines()
    assert good.startswith("ok\tbatch ")
    # A case with an id shows it; a line without one shows its number, never "None".
    assert bad.startswith("bad\tERROR\tline 2: ")
    assert "1 of 2 lines had errors" in _one_error_line(res, "bearsdk replay")
    res = _run_error_case(["replay", "--cases", "{d}/garbage.jsonl"], files)
    assert res.returncode == 2
    assert "None" not in res.stdout
    assert [ln.split("\t")[0] for ln in res.stdout.splitlines()] == ["line 1", "line 2"]
    assert "2 of 2 lines had errors" in _one_error_line(res, "bearsdk replay")
    res = _run_error_case(["replay", "--cases", "{d}/good.jsonl"], files)
    assert res.returncode == 0, res.stderr


def test_simulate_checks_the_output_before_running(files: Path) -> None:
    res = _run_error_case(
        ["simulate", "--config", "{d}/tiny.toml", "--out", MISSING + "/x.json"], files
    )
    assert res.returncode == 2
    assert "simulate [" not in res.stderr  # no run started: the progress bar never drew
    assert res.stdout == ""


# -- help -----------------------------------------------------------------------------


def _commands() -> list[list[str]]:
    from bearsdk.cli import build_parser

    parser = build_parser()
    out: list[list[str]] = [[]]
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            out.append([name])
            if sub._subparsers is not None:
                for a in sub._subparsers._group_actions:
                    out += [[name, b] for b in a.choices]
    return out


_REST = re.compile(r"``|:(func|class|mod|meth|attr|data|exc|ref|doc):`")


def test_help_is_plain_text() -> None:
    from bearsdk.cli import build_parser

    parser = build_parser()
    seen = 0
    for words in _commands():
        p = parser
        for w in words:
            p = p._subparsers._group_actions[0].choices[w]  # type: ignore[union-attr]
        text = p.format_help()
        assert not _REST.search(text), (words, _REST.search(text))
        seen += 1
    assert seen >= 15  # every command and benchmark was looked at


# -- Ctrl-C ---------------------------------------------------------------------------


def _interrupt(
    argv: list[str], ready: Callable[[str], bool], d: Path, stdin: str | None = None
) -> tuple[int, str, float]:
    """Start ``bearsdk ARGV``, wait for a line that ``ready`` accepts, Ctrl-C its group.

    Returns:
        Exit status, everything it wrote (standard output and error merged), and the
        seconds from the signal to its exit.
    """
    proc = subprocess.Popen(
        _bearsdk(*(a.replace("{d}", str(d)) for a in argv)),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=d,
        start_new_session=True,  # its own group: the signal reaches its workers too
    )
    lines: list[str] = []
    seen = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if ready(line):
                seen.set()
        seen.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.flush()
    try:
        assert seen.wait(240), "".join(lines)
        assert proc.poll() is None, "".join(lines)  # it must still be running
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        t.join(30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    return rc, "".join(lines), took


def _interrupted(rc: int, out: str, cmd: str) -> None:
    assert rc == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert "Unclosed" not in out, out[-3000:]
    assert out.count(f"{cmd}: interrupted") == 1, out[-3000:]


def test_ctrl_c_simulate_keeps_finished_runs(files: Path) -> None:
    out_file = files / "partial.json"
    rc, out, _ = _interrupt(
        [
            "simulate",
            "--config",
            "{d}/long.toml",
            "--workers",
            "2",
            "--out",
            str(out_file),
        ],
        lambda line: line.startswith("simulate ["),
        files,
    )
    _interrupted(rc, out, "bearsdk simulate")
    doc = json.loads(out_file.read_text())
    assert doc["interrupted"] is True
    assert 1 <= len(doc["results"]) < 12
    assert all(r["requests"] == 3000 for r in doc["results"])


def test_ctrl_c_simulate_in_one_process(files: Path) -> None:
    rc, out, _ = _interrupt(
        ["simulate", "--config", "{d}/long.toml", "--workers", "1"],
        lambda line: line.startswith("simulate ["),
        files,
    )
    _interrupted(rc, out, "bearsdk simulate")


def test_ctrl_c_emulate(files: Path) -> None:
    rc, out, _ = _interrupt(
        ["emulate", "--port", "0", "--scheduler", "{d}/mine.toml"],
        lambda line: "press Ctrl-C" in line,
        files,
    )
    assert "scheduler mine" in out  # the spec file was accepted
    _interrupted(rc, out, "bearsdk emulate")


def test_ctrl_c_replay_reading_stdin(files: Path) -> None:
    rc, out, _ = _interrupt(
        ["replay", "--cases", "-"],
        lambda line: line.startswith("ok\t"),
        files,
        stdin=json.dumps(CASE) + "\n",
    )
    _interrupted(rc, out, "bearsdk replay")


def test_ctrl_c_bench_emulator(files: Path) -> None:
    rc, out, _ = _interrupt(
        ["bench", "emulator", "--duration", "60", "--rate", "2"],
        lambda line: "offering" in line,
        files,
    )
    _interrupted(rc, out, "bearsdk bench emulator")


def test_ctrl_c_demo(files: Path) -> None:
    rc, out, _ = _interrupt(
        ["demo", "--duration", "30", "--rates", "4", "--policies", "bear", "--no-plot"],
        lambda line: line.startswith("bearsdk demo:"),
        files,
    )
    _interrupted(rc, out, "bearsdk demo")


def test_a_command_other_than_bench_loads_no_benchmark() -> None:
    # The benchmarks import most of the package: `bearsdk serve` and the others
    # start without them, and `bench` still lists and runs every one.
    code = (
        "import sys\n"
        "from bearsdk.cli import build_parser\n"
        "p = build_parser(sys.argv[1:])\n"
        "args, _ = p.parse_known_args(sys.argv[1:])\n"
        "print(sorted(m for m in sys.modules if m.startswith('bearsdk.bench.')))\n"
    )
    run = [sys.executable, "-c", code]
    out = subprocess.run([*run, "serve", "--config", "x.toml"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    out = subprocess.run([*run, "bench", "router", "--skip-proxy"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "'bearsdk.bench.router'" in out.stdout
    assert "'bearsdk.bench.decisions'" not in out.stdout  # (only the one named)
    # No benchmark named (`bearsdk bench --help`): every one is there to list.
    built = code.replace("args, _ = p.parse_known_args(sys.argv[1:])\n", "")
    out = subprocess.run([sys.executable, "-c", built, "bench"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "'bearsdk.bench.decisions'" in out.stdout  # (every one, for bench --help)
    assert "'bearsdk.bench.router'" in out.stdout


def test_the_parser_loads_none_of_the_heavy_modules() -> None:
    # Every command builds every command's parser: what one of them needs to
    # run (numpy, the emulator, the estimators, the predictors' LightGBM) is
    # imported when it runs, so that a bad argument or `--help` answers in a
    # tenth of a second, not half a second.
    heavy = ("numpy", "lightgbm", "aiohttp", "bearsdk.emulator", "bearsdk.estimators")
    code = (
        "import sys\n"
        "from bearsdk.cli import build_parser\n"
        "for argv in (['replay'], ['emulate'], ['demo'], ['train'], ['serve'], ['--help']):\n"
        "    build_parser(argv)\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_ctrl_c_python_could_not_raise_is_delivered_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seen in CI: the signal landed in importlib's weakref callback during an
    # import, Python printed "Exception ignored" and the demo ran to its end (0).
    import types

    from bearsdk._sigint import _hook

    def lose_one() -> None:
        # The hook returns first: raised inside it, the signal would be lost again
        # (seen under load: "Exception ignored in sys.unraisablehook").
        _hook(types.SimpleNamespace(exc_value=KeyboardInterrupt(), object=None))

    def run_on() -> None:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            pass

    lose_one()
    with pytest.raises(KeyboardInterrupt):  # then a check of the main thread raises it
        run_on()
    # Any other unraisable exception is reported as before.
    seen: list[object] = []
    monkeypatch.setattr(sys, "__unraisablehook__", seen.append)
    other = types.SimpleNamespace(exc_value=ValueError("x"), object=None)
    _hook(other)
    assert seen == [other]
