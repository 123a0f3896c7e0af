"""``cpullm bench suite``: serving benchmarks from JSON case files shaped like vLLM CPU's
``serving-tests-cpu*.json``, run the way its performance-benchmark script runs them.

A case file has ``defaults`` and ``tests``; each test (``test_name``, ``server_parameters``,
``server_environment_variables``, ``client_parameters``, ``qps_list``,
``max_concurrency_list``; every key but the name may come from ``defaults``) is one server
and one client run per request rate and concurrency. Parameters are flags: ``key: value``
is ``--key value`` (underscores become hyphens), ``""`` or ``true`` a bare switch.

For every case the runner writes the exact commands (``NAME.commands``, JSON) under the
results folder and, unless it is a dry run, starts the server, waits for ``/health``, runs
the clients (``NAME_qps_Q_concurrency_C.json`` each), stops the server, and in the end
writes ``benchmark_results.md`` (a table of every run) and a PNG plot per case (throughput
and latency against concurrency). A case that fails is reported and the suite goes on.
Environment, as vLLM's script reads it: ``DRY_RUN=1``, ``SERVING_JSON=file``,
``MODEL_FILTER``, ``DTYPE_FILTER`` (comma lists, exact names); ``ON_CPU=1`` is accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm.auto import tqdm

SUITE_DIR = Path(__file__).parent / "suite"
DEFAULT_SERVING_JSON = SUITE_DIR / "serving-tests-cpu.json"
_TEST_KEYS = {"test_name", "tier", "description", "server_parameters",
              "server_environment_variables", "client_parameters", "qps_list",
              "max_concurrency_list"}
_FIELDS = _TEST_KEYS - {"test_name", "tier", "description"}
_SUMMARY = "benchmark_results.md"


def add_suite_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serving-json", default=os.environ.get("SERVING_JSON"),
                        help="case file (default: $SERVING_JSON, else the text cases shipped "
                        "with cpullm; serving-tests-cpu-embed.json holds the embedding ones)")
    parser.add_argument("--results-dir", default="./benchmark/results",
                        help="folder of the .commands files, results and summary")
    parser.add_argument("--dry-run", action="store_true",
                        default=os.environ.get("DRY_RUN", "") not in ("", "0"),
                        help="write the commands only (default: $DRY_RUN=1)")
    parser.add_argument("--model-filter", default=os.environ.get("MODEL_FILTER") or None,
                        help="run only cases of these models, a comma list (default: "
                        "$MODEL_FILTER)")
    parser.add_argument("--dtype-filter", default=os.environ.get("DTYPE_FILTER") or None,
                        help="run only cases of these dtypes, a comma list (default: "
                        "$DTYPE_FILTER)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port of each case's server, unless its parameters give one")
    parser.add_argument("--server-timeout", type=float, default=1200.0,
                        help="seconds a server may take to answer /health")


@dataclass
class Case:
    """One test of a case file, its defaults applied."""

    name: str
    server: dict[str, Any]
    env: dict[str, str]
    client: dict[str, Any]
    qps: list[float | str]
    concurrency: list[int | None]

    @property
    def model(self) -> str:
        return str(self.server.get("model", ""))

    @property
    def dtype(self) -> str:
        return str(self.server.get("dtype", "auto"))

    def run_name(self, qps: float | str, concurrency: int | None) -> str:
        return f"{self.name}_qps_{qps}_concurrency_{concurrency}"


@dataclass
class RunRow:
    case: str
    qps: float | str
    concurrency: int | None
    result: dict[str, Any] | None = None
    error: str = ""
    embeddings: bool = False


@dataclass
class SuiteReport:
    rows: list[RunRow] = field(default_factory=list)
    summary: Path | None = None
    plots: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> list[RunRow]:
        return [r for r in self.rows if r.error]


def load_cases(path: str | os.PathLike[str]) -> list[Case]:
    """Read and check a case file; an error names the case and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"serving JSON {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"serving JSON {path}: not valid JSON: {e}") from None
    if isinstance(data, list):  # a bare list of tests, as older vLLM files are
        data = {"tests": data}
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list):
        raise ValueError(f"serving JSON {path}: expected an object with a \"tests\" list")
    defaults = data.get("defaults") or {}
    _check_fields(defaults, f"serving JSON {path}: defaults", allowed=_FIELDS)
    cases, seen = [], set()
    for i, test in enumerate(data["tests"]):
        where = f"serving JSON {path}: test {i}"
        if not isinstance(test, dict):
            raise ValueError(f"{where}: expected an object")
        name = test.get("test_name")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{where}: key \"test_name\": expected a name without '/'")
        where = f"serving JSON {path}: test {name!r}"
        if name in seen:
            raise ValueError(f"{where}: the name is used twice")
        seen.add(name)
        _check_fields(test, where, allowed=_TEST_KEYS)
        merged = {k: ({**defaults.get(k, {}), **test[k]} if isinstance(test.get(k), dict)
                      else test.get(k, defaults.get(k))) for k in _FIELDS}
        qps = merged["qps_list"] or ["inf"]
        concurrency = merged["max_concurrency_list"] or [None]
        for q in qps:
            if not (q == "inf" or (isinstance(q, int | float) and not isinstance(q, bool)
                                   and q > 0)):
                raise ValueError(f"{where}: key \"qps_list\": {q!r} is not a positive number "
                                 "or \"inf\"")
        for c in concurrency:
            if c is not None and not (isinstance(c, int) and not isinstance(c, bool) and c > 0):
                raise ValueError(f"{where}: key \"max_concurrency_list\": {c!r} is not a "
                                 "positive integer")
        cases.append(Case(name, merged["server_parameters"] or {},
                          {k: str(v) for k, v in (merged["server_environment_variables"]
                                                  or {}).items()},
                          merged["client_parameters"] or {}, list(qps), list(concurrency)))
    return cases


def _check_fields(test: dict[str, Any], where: str, allowed: set[str]) -> None:
    if not isinstance(test, dict):
        raise ValueError(f"{where}: expected an object")
    for key, value in test.items():
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r}")
        if key in ("server_parameters", "client_parameters", "server_environment_variables"):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: key {key!r}: expected an object")
            for name, v in value.items():
                if isinstance(v, dict | type(None)) or (
                        isinstance(v, list) and key == "server_environment_variables"):
                    raise ValueError(f"{where}: key {key!r}: {name!r} has a value of type "
                                     f"{type(v).__name__}")
        if key in ("qps_list", "max_concurrency_list") and not isinstance(value, list):
            raise ValueError(f"{where}: key {key!r}: expected a list")


def to_flags(params: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enforce_eager": ""}`` -> ``--max-num-seqs 8 --enforce-eager``."""
    flags: list[str] = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        if value == "" or value is True:
            flags.append(flag)
        elif value is False:
            continue
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def select(cases: list[Case], model_filter: str | None, dtype_filter: str | None) -> list[Case]:
    models = {m.strip() for m in model_filter.split(",") if m.strip()} if model_filter else None
    dtypes = {d.strip() for d in dtype_filter.split(",") if d.strip()} if dtype_filter else None
    return [c for c in cases if (models is None or c.model in models)
            and (dtypes is None or c.dtype in dtypes)]


def _commands(case: Case, port: int,
              results: Path) -> tuple[list[str], str, list[tuple[str, list[str]]]]:
    """The server's arguments, its base URL and, per run, its name and the client's
    arguments."""
    server = dict(case.server)
    server.setdefault("port", port)
    base_url = f"http://{server.get('host', '127.0.0.1')}:{server['port']}"
    server_args = ["serve", *to_flags(server)]
    client = dict(case.client)
    if "tokenizer" not in client and os.path.exists(case.model):
        client["tokenizer"] = case.model  # a local model tokenizes its own prompts
    runs = []
    for qps in case.qps:
        for concurrency in case.concurrency:
            name = case.run_name(qps, concurrency)
            extra = {"base_url": base_url, "request_rate": qps,
                     "save_result": True, "result_dir": str(results),
                     "result_filename": f"{name}.json"}
            if concurrency is not None:
                extra["max_concurrency"] = concurrency
            runs.append((name, ["bench", "serve", *to_flags({**client, **extra})]))
    return server_args, base_url, runs


def _shell(env: dict[str, str], args: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "cpullm",
                     *map(shlex.quote, args)])


def run_suite(args: argparse.Namespace) -> SuiteReport:
    path = args.serving_json or DEFAULT_SERVING_JSON
    cases = select(load_cases(path), args.model_filter, args.dtype_filter)
    if not cases:
        raise ValueError(f"no case of {path} matches MODEL_FILTER={args.model_filter or ''!r} "
                         f"DTYPE_FILTER={args.dtype_filter or ''!r}")
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    report = SuiteReport()
    total = sum(len(c.qps) * len(c.concurrency) for c in cases)
    bar = tqdm(total=total, desc="Suite runs", disable=args.dry_run)
    for case in cases:
        server_args, base_url, runs = _commands(case, args.port, results)
        server_command = _shell(case.env, server_args)
        for name, client_args in runs:
            (results / f"{name}.commands").write_text(json.dumps(
                {"server_command": server_command,
                 "client_command": _shell({}, client_args)}, indent=4) + "\n")
        if args.dry_run:
            print(f"{case.name}: commands written ({len(runs)} client runs)")
            continue
        report.rows += _run_case(case, server_args, base_url, runs, results, args, bar)
    bar.close()
    if not args.dry_run:
        report.summary = write_summary(report.rows, results)
        report.plots = write_plots(report.rows, results)
        for row in report.failed:
            print(f"FAILED {row.case} (qps {row.qps}, concurrency {row.concurrency}): "
                  f"{row.error}", file=sys.stderr)
    return report


def _cpullm(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "cpullm.entrypoints.cli", *args]


def _run_case(case: Case, server_args: list[str], base_url: str,
              runs: list[tuple[str, list[str]]], results: Path, args: argparse.Namespace,
              bar: tqdm) -> list[RunRow]:
    embeddings = case.client.get("backend") == "openai-embeddings"
    rows = [RunRow(case.name, q, c, embeddings=embeddings)
            for q in case.qps for c in case.concurrency]
    log_path = results / f"{case.name}.server.log"
    log = log_path.open("w")
    server = subprocess.Popen(_cpullm(server_args), env={**os.environ, **case.env},
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        error = _wait_healthy(server, f"{base_url}/health", args.server_timeout, log_path)
        for row, (name, client_args) in zip(rows, runs, strict=True):
            if error:
                row.error = error
            else:
                done = subprocess.run(_cpullm(client_args), capture_output=True, text=True)
                out = results / f"{name}.json"
                if done.returncode != 0 or not out.is_file():
                    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
                    row.error = f"client exited {done.returncode}: {tail[0]}"
                else:
                    row.result = json.loads(out.read_text())
            bar.update(1)
    finally:
        _stop(server)
        log.close()
    return rows


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float, log: Path) -> str:
    """'' once ``url`` (the server's /health) answers 200; else why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            last = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            return f"the server exited with status {server.returncode}: {last[0][:300]}"
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return ""
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"the server did not answer {url} within {timeout:.0f} s"


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _throughput(row: RunRow) -> tuple[str, float]:
    assert row.result is not None
    if row.embeddings:
        return "texts/s", row.result["request_throughput"]
    return "output tok/s", row.result["output_throughput"]


def write_summary(rows: list[RunRow], results: Path) -> Path:
    lines = ["# cpullm serving benchmarks", "",
             "| Test | QPS | Concurrency | Requests/s | Throughput | Median TTFT (ms) | "
             "Median TPOT (ms) | P99 TTFT (ms) | Median E2E (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.result is None:
            lines.append(f"| {row.case} | {row.qps} | {row.concurrency} | failed: "
                         f"{row.error.replace('|', '/')} | | | | | |")
            continue
        r = row.result
        unit, value = _throughput(row)
        latency = ("-", "-", "-") if row.embeddings else (
            f"{r['median_ttft_ms']:.1f}", f"{r['median_tpot_ms']:.1f}", f"{r['p99_ttft_ms']:.1f}")
        lines.append(f"| {row.case} | {row.qps} | {row.concurrency} | "
                     f"{r['request_throughput']:.2f} | {value:.1f} {unit} | {latency[0]} | "
                     f"{latency[1]} | {latency[2]} | {r['median_e2el_ms']:.1f} |")
    path = results / _SUMMARY
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_series(rows: list[RunRow]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per case, per panel, per request rate: the curve against concurrency (x first)."""
    series: dict[str, dict[str, dict[str, list[float]]]] = {}
    for row in rows:
        if row.result is None or row.concurrency is None:
            continue
        unit, value = _throughput(row)
        panels = {f"throughput ({unit})": value}
        if row.embeddings:
            panels["median latency (ms)"] = row.result["median_e2el_ms"]
        else:
            panels["median TTFT (ms)"] = row.result["median_ttft_ms"]
            panels["median TPOT (ms)"] = row.result["median_tpot_ms"]
        for panel, y in panels.items():
            curve = series.setdefault(row.case, {}).setdefault(panel, {}).setdefault(
                f"qps {row.qps}", [])
            curve.append((row.concurrency, y))  # type: ignore[arg-type]
    return series


def write_plots(rows: list[RunRow], results: Path) -> list[Path]:
    """A PNG per case: a panel per figure, a line per request rate, against concurrency.
    The series are also written as ``NAME.plot.json``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed (pip install 'cpullm[bench]'); "
              "the table is written without them", file=sys.stderr)
        return []
    paths = []
    for case, panels in plot_series(rows).items():
        figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4),
                                    squeeze=False)
        for ax, (panel, curves) in zip(axes[0], panels.items(), strict=True):
            for label, points in curves.items():
                points = sorted(points)
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=label)
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(panel)
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend()
        figure.suptitle(case)
        figure.tight_layout()
        path = results / f"{case}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        (results / f"{case}.plot.json").write_text(json.dumps(panels, indent=2) + "\n")
        paths.append(path)
    return paths
