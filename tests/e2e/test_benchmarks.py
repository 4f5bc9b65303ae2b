"""Every benchmark script under benchmarks/ runs, in its smoke mode (seconds), so none rots unnoticed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

BENCH = REPO / "benchmarks"


def run(script: str, *args: object, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)]), **(env or {})})
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_every_script_has_a_test():
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    tested = {"bench_convert.py", "bench_verify.py", "bench_load.py", "load_paths.py", "bench_startup.py",
              "probe_register.py",
              "bench_probe.py",
              "bench_pin.py", "report_pin.py",  # bench_pin --smoke: below
              "profile_convert.py", "make_report.py", "report_startup.py", "device_startup.sh",
              "bench_store.py", "store_child.py",  # bench_store.py --quick: below
              "bench_daemon.py", "report_daemon.py",
              "report_store.py", "report_probe.py",
              "bench_node.py", "node_forms.py", "node_procs.py", "node_zygote.py", "device_node.sh",
              "report_node.py",
              "node_forms_sglang.py", "report_node_sglang.py",  # bench_node --engine sglang --quick: below
              "bench_boot.py", "boot_child.py", "device_boot.sh", "report_boot.py",
              "report_fixed.py",  # tests/unit/test_report_boot.py, and make_report below
              "boot_child_sglang.py",  # bench_boot --engine sglang --smoke: below
              "probe_timer.py",  # through bench_boot and bench_node's rank processes, below
              "bench_recovery.py", "report_recovery.py", "device_recovery.sh",
              "gpu_load_formats.py",  # --smoke: tests/engines/test_*_format_matrix.py
              "common.py",  # common.py: through every script that imports it
              "report_gains.py", "report_convert.py", "report_verify.py", "report_load.py", "device_carry.py"}
    # bench_node --quick: below; report_*: make_report regenerating docs/benchmarks.md exactly;
    # bench_daemon --smoke: tests/engines/test_vllm_weight_cache.py; device_carry: its selection below
    assert set(scripts) == tested, set(scripts) ^ tested


def test_readme_names_every_benchmark_and_every_result():
    """benchmarks/README.md's tables name every script and every entry of results/ (a name or a glob)."""
    import fnmatch

    readme = (BENCH / "README.md").read_text()
    named = {token.rstrip("/") for token in re.findall(r"`([^`\s]+)`", readme)}
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("report_")}
    assert scripts <= named, scripts - named
    results = {p.name for p in (BENCH / "results").iterdir()}
    unnamed = {r for r in results if not any(fnmatch.fnmatch(r, n) for n in named)}
    assert not unnamed, unnamed


def test_results_hold_only_what_the_report_reads(monkeypatch, tmp_path):
    """Every entry of benchmarks/results/ has a file that make_report.py reads: a run the page no longer
    cites is removed (git keeps it), not left beside the ones it cites."""
    import pathlib

    results = BENCH / "results"
    read: set[pathlib.Path] = set()
    real_read_text = pathlib.Path.read_text

    def recording(self: pathlib.Path, *args: object, **kwargs: object) -> str:
        read.add(pathlib.Path(self).resolve())
        return real_read_text(self, *args, **kwargs)

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(pathlib.Path, "read_text", recording)
    import make_report

    make_report.main(["--no-plots", "--out", str(tmp_path / "benchmarks.md")])
    cited = {p.relative_to(results.resolve()).parts[0] for p in read if results.resolve() in p.parents}
    assert cited == {p.name for p in results.iterdir()}, {p.name for p in results.iterdir()} ^ cited


def test_scripts_answer_help():
    """Every runnable script parses its flags (``--help``) without a GPU or an engine."""
    for script in ("device_carry.py", "make_report.py", "bench_node.py"):
        out = run(script, "--help", timeout=120)
        assert "usage:" in out, (script, out)


def test_device_carry_keeps_what_imports_reach(tmp_path):
    """device_carry.py's selection on a made-up installed package: sources and data travel, tests,
    caches, headers and binaries do not; a compiled extension that an import loaded asks for its
    wheel; a package the trace never reached, or one the device has, is not carried."""
    sys.path.insert(0, str(BENCH))
    import tarfile

    import device_carry as dc

    site = tmp_path / "site"
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/data.json": b"{}", "pkg/_c.cpython-311-x86_64-linux-gnu.so":
             b"\x7fELF...", "pkg/_d.abi3.so": b"\x7fELF...", "pkg/libpkg.so": b"\x7fELF...",
             "pkg/tests/test_pkg.py": b"",
             "pkg/__pycache__/x.cpython-311.pyc": b"", "pkg/include/a.h": b"", "pkg/tool": b"\x7fELF...",
             "other.py": b"", "torch/__init__.py": b""}
    for name, dist in (("pkg", [f for f in files if f.startswith("pkg/")]), ("other", ["other.py"]),
                       ("torch", ["torch/__init__.py"])):
        meta = site / f"{name}-1.0.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        listed = [*dist, f"{meta.name}/METADATA", f"{meta.name}/RECORD"]
        (meta / "RECORD").write_text("".join(f"{f},,\n" for f in listed))
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)

    chosen = dc.select([site], {"os", "pkg", "pkg.sub", "torch"})
    assert [d.name for d in chosen] == ["pkg"]  # other: never imported; torch: the device has it
    pkg = chosen[0]
    assert sorted(map(str, pkg.pure_files())) == ["pkg-1.0.dist-info/METADATA", "pkg/__init__.py", "pkg/data.json"]
    assert set(pkg.extensions()) == {"pkg._c", "pkg._d", "pkg.libpkg"}  # by name: a library may be one
    # a version-specific extension loaded: the wheel; an abi3 one, or its own library opened by path:
    # its native files that fit any Python travel as installed
    library = os.path.realpath(site / "pkg" / "libpkg.so")
    assert not dc.needs_wheel(pkg, {"pkg"}) and dc.needs_wheel(pkg, {"pkg", "pkg._c"})
    assert not dc.needs_wheel(pkg, {"pkg", "pkg._d"}) and not dc.needs_wheel(pkg, {"pkg", library})
    assert pkg.carried({"pkg"}) == pkg.pure_files()
    native = sorted([*map(str, pkg.pure_files()), "pkg/_d.abi3.so", "pkg/libpkg.so"])
    assert sorted(map(str, pkg.carried({"pkg", "pkg._d"}))) == sorted(map(str, pkg.carried({"pkg", library}))) == native
    raw = dc.pack([pkg], tmp_path / "site.tar.xz", {"pkg", "pkg._d"})
    with tarfile.open(tmp_path / "site.tar.xz") as tar:
        assert sorted(tar.getnames()) == sorted(map(str, pkg.carried({"pkg", "pkg._d"})))
    assert raw == sum((site / f).stat().st_size for f in pkg.carried({"pkg", "pkg._d"}))


def test_device_carry_traces_the_engine_modules_the_benchmarks_name():
    """The modules traced for vLLM are the ones the benchmarks, the harness and the project's vLLM
    code import (read from their source), so a benchmark's new import is carried without a list to edit."""
    sys.path.insert(0, str(BENCH))
    import device_carry as dc

    found = dc.engine_modules("vllm==0.33.0")
    for module in ("vllm.model_executor.model_loader", "vllm.config", "vllm.engine.arg_utils"):
        assert module in found, module
    assert found[0] == "vllm_harness" and all(m == "vllm" or m.startswith("vllm.") for m in found[1:])
    sglang = dc.engine_modules("sglang==0.5.23")
    assert "sglang_harness" in sglang  # the torchvision stand-in, imported before SGLang
    assert all(m.startswith("sglang") for m in sglang)


def test_bench_convert_smoke_is_what_make_bench_runs_fixed(tmp_path):
    """`make bench` imported a name the package no longer has; the smoke run goes through the same code."""
    summary = last_json(run("bench_convert.py", "--smoke", "--workdir", tmp_path))
    assert summary["benchmark"] == "convert" and summary["expert_bytes"] > 0 and summary["convert_s"] > 0
    assert summary["mode"] == "nofsync" and summary["ratio_vs_copy"] > 0
    # the copy writes the rank files' bytes (the conversion's, less its small files) into as many files
    assert 0.99 * summary["expert_bytes"] < summary["copy_bytes"] <= summary["expert_bytes"]
    assert summary["files"] == summary["ep_size"] * summary["layers"]
    (row,) = summary["rows"]  # every round's pair, and the peak RSS of a fresh process converting once
    assert len(row["copy_runs"]) == len(row["convert_runs"]) == summary["repeats"]
    assert row["peak_rss_mb"] > row["baseline_rss_mb"] > 0
    disk = summary["machine"]["disk"]  # where the result was measured
    assert disk["filesystem"]["fs"] and disk["free_gb"] > 0 and summary["machine"]["cpus"] >= 1
    makefile = (REPO / "Makefile").read_text()
    assert "$(PY) benchmarks/bench_convert.py --quick" in makefile  # the same script and parser


def test_bench_verify_smoke(tmp_path):
    summary = last_json(run("bench_verify.py", "--smoke", "--workdir", tmp_path))
    assert summary["benchmark"] == "verify" and summary["rank_bytes"] > 0 and summary["verify_s"] > 0


def test_bench_verify_numerics_smoke(tmp_path):
    summary = last_json(run("bench_verify.py", "--numerics", "--smoke", "--workdir", tmp_path))
    levels = summary["levels"]
    assert summary["benchmark"] == "verify-numerics" and levels["verify"]["numerics_checks"] == 0
    assert levels["numerics"]["numerics_checks"] == 2 and levels["numerics_every_rank"]["numerics_checks"] == 4


def test_bench_load_smoke(tmp_path):
    summary = last_json(run("bench_load.py", "--smoke", "--workdir", tmp_path))
    assert summary["benchmark"] == "load" and summary["all_correct"] is True and summary["rank_bytes"] > 0


def test_probe_register_smoke(tmp_path):
    out = run("probe_register.py", "--smoke", "--workdir", tmp_path)
    assert "files" in out and (tmp_path / "out" / "manifest.json").exists()


def test_profile_convert_smoke(tmp_path):
    out = run("profile_convert.py", "--smoke", "--workdir", tmp_path)
    assert re.search(r"convert [\d.]+ s with the checksum|A/B, same process", out), out


def test_make_report_regenerates_the_published_report(tmp_path):
    """docs/benchmarks.md is exactly what the saved results give (report_startup.py makes its start-up
    section); the plots need matplotlib (the `bench` extra) and are left out here."""
    run("make_report.py", "--no-plots", "--out", tmp_path / "benchmarks.md")
    assert (tmp_path / "benchmarks.md").read_text() == (REPO / "docs" / "benchmarks.md").read_text()


def test_device_startup_script_parses_and_its_runs_use_real_flags():
    subprocess.run(["bash", "-n", str(BENCH / "device_startup.sh")], check=True)
    sys.path.insert(0, str(BENCH))
    import bench_startup

    text = (BENCH / "device_startup.sh").read_text().replace("\\\n", " ")
    calls = [re.split(r"\s(?:\d?>|\|)", line.split("$BENCH", 1)[1])[0]
             for line in text.splitlines() if "$BENCH " in line and not line.lstrip().startswith("#")]
    assert len(calls) >= 3
    for call in calls:
        args = [a for a in shlex.split(call.replace("$RESULTS", "/tmp/r").replace("$layers", "1")
                                       .replace("$name", "n"))]
        bench_startup.parse_args(args)  # exits (SystemExit) on an unknown flag


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_startup_smoke_in_vllm_033(tmp_path):
    """The start-up benchmark's children build vLLM 0.33's real modules (on the CPU here) and load them
    both ways; their results must be identical."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    engine = os.pathsep.join(map(str, ensure("vllm==0.33.0")))
    out = run("bench_startup.py", "--smoke", "--work", tmp_path, "--vllm", f"0.33={engine}",
              "--save", tmp_path / "s.json", env={"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [row["method"] for row in summary["single"]] == ["ours", "vllm033_all"]
    assert summary["identical"] == {"redundant=0": True}, out


def device_script_flags(script: str, benchmark: str, extra: str) -> list[str]:
    """The flags a device script's first (non-comment) line passes ``benchmark``, with its shell variables
    filled in (``${*:2}``: ``extra``); the script is checked to parse first."""
    subprocess.run(["bash", "-n", str(BENCH / script)], check=True)
    sys.path.insert(0, str(BENCH))
    text = (BENCH / script).read_text().replace("\\\n", " ")
    line = next(row for row in text.splitlines() if benchmark in row and not row.lstrip().startswith("#"))
    return shlex.split(line.split(benchmark, 1)[1].split(">", 1)[0].replace("$WORK", "/tmp/w")
                       .replace("$1", "60").replace("${*:2}", extra).replace("$RESULTS", "/tmp/r"))


def test_device_node_script_parses_and_runs_real_flags():
    flags = device_script_flags("device_node.sh", "bench_node.py", "--shapes slice")
    import bench_node

    args = bench_node.parse_args(flags)  # exits (SystemExit) on an unknown flag
    assert args.budget_s == 60 and str(args.save) == "/tmp/r/node.json" and args.shapes == ["slice"]


def test_device_node_sglang_formats_step_passes_flags_its_scripts_declare():
    """``device_node.sh sglang-formats`` runs the two GPU proofs with flags each script's parser declares."""
    scripts = {"gpu_load_formats.py": BENCH / "gpu_load_formats.py",
               "gpu_sglang_weight_cache.py": REPO / "tests" / "engines" / "gpu_sglang_weight_cache.py"}
    for name, path in scripts.items():
        flags = [f for f in device_script_flags("device_node.sh", name, "") if f.startswith("--")]
        assert flags, name
        declared = set(re.findall(r"add_argument\(\"(--[\w-]+)\"", path.read_text()))
        assert set(flags) <= declared, (name, set(flags) - declared)


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_node_quick_in_vllm_033(tmp_path):
    """The node benchmark on the CPU: two rank processes per form (forked from one import of the engine:
    node_zygote.py), released together, loading through vLLM 0.33's own loaders (with and without its EP
    filter), install() from the per-rank form and the store, and an ipc_cache restart into vLLM's real
    modules, each form once, in one shape or the other;
    every form that ran leaves the same kernel bytes, and a form that cannot run here says why."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    path = os.pathsep.join([*map(str, ensure("vllm==0.33.0")), str(REPO), str(BENCH)])
    run("bench_node.py", "--quick", "--work", tmp_path, "--save", tmp_path / "n.json", timeout=1800,
        env={"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path})
    result = json.loads((tmp_path / "n.json").read_text())
    assert [(s["shape"], s["ep_size"]) for s in result["steps"]] == [("node-l1", 2), ("slice-l1", 8)]
    node, piece = ({(r["form"], r["cache"]): r for r in step["rows"]} for step in result["steps"])
    for rows, forms in ((node, ("auto", "megamoe_per_rank")), (piece, ("auto_ep_filter", "megamoe_store"))):
        assert sorted(f for f, _ in rows) == sorted([*forms, "pipe", "host_read", "h2d"] +
                                                    (["instanttensor", "ipc_cache"] if rows is node else []))
        for form in (*forms, "host_read"):
            row = rows[(form, "warm")]
            assert [r["rank"] for r in row["ranks"]] == [0, 1] and row["node_wall_s"] > 0, row
        for ceiling in ("h2d", "pipe"):
            assert "needs a CUDA GPU" in rows[(ceiling, "warm")]["skipped"]
    assert node[("ipc_cache", "restart")]["node_wall_s"] > 0
    assert "needs a CUDA GPU" in node[("instanttensor", "warm")]["skipped"]
    # each megamoe rank's probe passed while its model was built: its install probed nothing more
    assert result["layout_probe"] is True
    for r in node[("megamoe_per_rank", "warm")]["ranks"] + piece[("megamoe_store", "warm")]["ranks"]:
        steps = {k: v for k, v in r["probe_parts_s"].items() if k != "engine"}  # the comparison never ran
        assert r["probe_calls"] == 1 and steps == dict.fromkeys(("input", "reference", "compare", "fingerprint"), 0), r
    # a measurement is released only once every process of its batch is built and idle, and a batch's
    # processes start only once the batch before it has ended: nothing imports beside a measurement
    for step in result["steps"]:
        batches = sorted({row["batch"] for row in step["rows"]})
        assert len(batches) > 1, step["rows"]
        ended = 0.0
        for batch in batches:
            timed = [row for row in step["rows"] if row["batch"] == batch and "ranks" in row]
            if not timed:
                continue
            ranks = [r for row in timed for r in row["ranks"]]
            built = max(r["ready_unix"] for r in ranks)
            assert all(min(r["start_unix"] for r in row["ranks"]) > built for row in timed), timed
            assert min(r["start_unix"] - r["ready_s"] for r in ranks) > ended, timed  # when each process began
            ended = max(r["end_unix"] for r in ranks)
    # every form that loaded left the same kernel bytes, rank by rank, in each shape
    assert len(result["identical"]) == 4 and all(result["identical"].values()), result["identical"]


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_node_quick_in_sglang_0523(tmp_path):
    """The node benchmark's SGLang forms on the CPU: two rank processes per form, released together, loading
    through SGLang 0.5.23's presharded first run (its DefaultModelLoader's load) and reload, restarts mapping
    its weight-cache daemons (loaded from the source by its DefaultModelLoader, and as megamoe preload's from
    the per-rank form by install()) and install() from the store, into SGLang's real Hopper FP8 MegaMoE
    modules. Every form leaves the same kernel bytes; a restart from SGLang's own daemons leaves the modules
    without the MegaMoE tuples, every other form with them."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    path = os.pathsep.join([*map(str, ensure("sglang==0.5.23")), str(REPO), str(BENCH)])
    run("bench_node.py", "--engine", "sglang", "--quick", "--work", tmp_path, "--save", tmp_path / "n.json",
        timeout=1800, env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path})
    result = json.loads((tmp_path / "n.json").read_text())
    (step,) = result["steps"]
    assert (result["engine"], step["shape"], step["ep_size"]) == ("sglang", "node-l1", 2)
    rows = {(r["form"], r["cache"]): r for r in step["rows"]}
    loads = ("presharded_dump", "presharded", "megamoe_store")
    restarts = ("ipc_cache", "ipc_cache_megamoe")
    assert sorted(rows) == sorted([(f, "warm") for f in (*loads, "pipe", "host_read", "h2d")] +
                                  [(f, "restart") for f in restarts])
    for key in [(f, "warm") for f in loads] + [(f, "restart") for f in restarts]:
        row = rows[key]
        assert [r["rank"] for r in row["ranks"]] == [0, 1] and row["node_wall_s"] > 0, row
        assert all(r["kernel_tuples"] is (key[0] != "ipc_cache") for r in row["ranks"]), row
    assert all(r["written_bytes"] > 0 for r in rows[("presharded_dump", "warm")]["ranks"])
    assert "needs a CUDA GPU" in rows[("pipe", "warm")]["skipped"]
    assert len(result["identical"]) == 2 and all(result["identical"].values()), result["identical"]


def test_node_report_sets_apart_warm_rows_run_right_after_their_files_first_read():
    """Of a run that read a warm row's files once before it, a warm row whose files no row since the
    last drop had read (a row that did not run reads nothing) is left out of the medians and named in
    the notes; a run that read them twice sets none apart."""
    sys.path.insert(0, str(BENCH))
    import report_node

    def row(form: str, cache: str, seconds: float = 1.0) -> dict:
        return {"form": form, "cache": cache, "node_wall_s": seconds}

    rows = [row("megamoe_store", "cold"), row("megamoe_per_rank", "warm", 2.0), row("megamoe_per_rank", "cold"),
            row("megamoe_per_rank", "warm"), row("disk_read", "cold"), row("pipe", "warm"), row("h2d", "warm"),
            {"form": "auto", "cache": "cold", "failed": "ended"}, row("auto", "warm", 3.0)]
    result = {"steps": [{"shape": "node-l8", "round": 1, "rows": rows}]}
    assert [r for _, r in report_node.unprimed(result)] == [rows[1], rows[8]]
    assert report_node.by_shape(result)["node-l8"][("megamoe_per_rank", "warm")] == [rows[3]]
    assert ("auto", "warm") not in report_node.by_shape(result)["node-l8"]
    notes = report_node.method_notes(result)
    assert "left out of the medians" in notes and "2.000 s" in notes and "3.000 s" in notes, notes
    twice = {**result, "warm_reads": 2}
    assert report_node.unprimed(twice) == [] and "left out" not in report_node.method_notes(twice)


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_pin_smoke_starts_every_rank_and_checks_their_bytes(tmp_path):
    """The ring-pinning benchmark on the CPU: every rank process started at once, each building and
    loading its own file, the bytes checked, and the medians against the no-ring reference."""
    run("bench_pin.py", "--smoke", "--work", tmp_path, "--save", tmp_path / "pin.json")
    result = json.loads((tmp_path / "pin.json").read_text())
    (row,) = result["rows"]
    assert result["smoke"] and row["mode"] == "pageable" and [r["rank"] for r in row["ranks"]] == [0, 1]
    assert all(r["bytes_ok"] and r["build_s"] > 0 and r["load_s"] > 0 for r in row["ranks"])
    assert result["load_bytes"] == (tmp_path / "load-1.bin").stat().st_size > 0
    (got,) = result["summary"]
    assert (got["mode"], got["cache"]) == ("pageable", "warm")
    assert got["build_over_pageable_s"] == 0 and got["total_s"] >= got["build_s"]


def test_bench_probe_smoke_in_vllm_033(tmp_path):
    """The layout probe's benchmark: fresh children install into vLLM 0.33's real modules (on the CPU here)
    with and without the probe; the probe ran (once per process) and both give the same experts."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    engine = os.pathsep.join(map(str, ensure("vllm==0.33.0")))
    run("bench_probe.py", "--quick", "--work", tmp_path, "--vllm", engine, "--save", tmp_path / "p.json",
        env={"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    summary = json.loads((tmp_path / "p.json").read_text())
    assert [r["method"] for r in summary["runs"]] == ["unprobed", "probed"]
    probed, unprobed = summary["runs"][1], summary["runs"][0]
    assert probed["probe_calls"] >= 1 and "probe_calls" not in unprobed and summary["identical"]
    assert summary["probe_gpu_bytes"] is None and summary["one_expert_bytes"] > 0
    assert set(summary["probe_phases_s"]) == {"input", "reference", "engine", "compare", "fingerprint"}
    assert sum(summary["probe_phases_s"].values()) <= summary["probe_s"]


# ----------------------------------------------------------------------------- bench_store.py

def test_the_store_benchmark_runs_its_cpu_smoke_mode(tmp_path):
    """benchmarks/bench_store.py --quick: first calls in fresh processes, store vs per-rank form,
    with a form under other settings and one from a baseline checkout (this one) side by side; each
    form in one warm case, each case (the staging started early, ready, not started) in one form."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_store.py"), "--quick", "--workdir",
                           str(tmp_path / "work"), "--save", str(tmp_path / "out.json"),
                           "--store-knobs", "MEGAMOE_READ_THREADS=2", "--baseline-tree", str(REPO)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "out.json").read_text()) | {"on_disk": summary["on_disk"]}
    (row,) = summary["rows"]
    assert row["ep_size"] == 2 and row["rank"] == 1 and row["same_bytes"] is True
    assert row["forms"] == ["per_rank", "store", "store MEGAMOE_READ_THREADS=2", "store_baseline"]
    for key in ("per_rank_warm", "store_warm_ready", "store MEGAMOE_READ_THREADS=2_warm_unprepared",
                "store_baseline_warm", "host_read", "h2d_pinned"):
        assert row[key]["seconds"] > 0 and row[key]["gb_per_s"] > 0, key
    assert summary["baseline_tree"]["path"] == str(REPO)
    disk = summary["on_disk"]["2"]
    assert disk["store_expert_bytes"] < disk["per_rank_expert_bytes_all_ranks"]  # the shared expert once, not twice


@pytest.mark.parametrize("flags, message", [
    (["--store-knobs", "RING_MB=8"], "expected MEGAMOE_NAME=VALUE settings"),
    (["--cold-knobs", "MEGAMOE_WILLNEED"], "expected MEGAMOE_NAME=VALUE settings"),
    (["--baseline-tree", "."], None),  # tmp_path: not a checkout
])
def test_the_store_benchmark_refuses_bad_forms_before_converting_anything(tmp_path, flags, message):
    flags = [str(tmp_path) if f == "." else f for f in flags]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_store.py"), "--quick", "--workdir",
                           str(tmp_path / "work"), *flags], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (message or "expected a megamoe-convert checkout") in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "work").exists()


def test_device_boot_script_parses_and_runs_real_flags():
    flags = device_script_flags("device_boot.sh", "bench_boot.py", "--rounds 2")
    import bench_boot

    args = bench_boot.parse_args(flags)  # exits (SystemExit) on an unknown flag
    assert args.budget_s == 60 and args.clean and args.node_caches == ["warm"] and args.rounds == 2


def test_device_boot_sglang_job_runs_real_flags():
    """``device_boot.sh sglang-job`` runs bench_boot.py --engine sglang with flags its parser declares."""
    flags = device_script_flags("device_boot.sh", "bench_boot.py --engine sglang", "--slice-layers 12")
    import bench_boot

    args = bench_boot.parse_args(["--engine", "sglang", *flags])  # exits (SystemExit) on an unknown flag
    assert args.engine == "sglang" and args.preset == "qwen3-moe" and args.experts == 128
    assert args.budget_s == 60 and args.clean and args.node_caches == ["warm"] and args.slice_layers == 12
    assert str(args.save) == "$SG_RESULTS/boot.json"  # the job's own results folder, not the vLLM job's


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_boot_smoke_in_sglang_0523(tmp_path):
    """A whole start on the CPU: SGLang 0.5.23's real Qwen3MoeForCausalLM built and loaded by SGLang's own
    get_model_loader(...).load_model, --load-format auto against --load-format megamoe (the plugin loaded as
    SGLang loads it), both shapes, every phase timed, every parameter's bytes the same both ways."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    path = os.pathsep.join([*map(str, ensure("sglang==0.5.23")), str(REPO), str(BENCH)])
    run("bench_boot.py", "--engine", "sglang", "--smoke", "--work", tmp_path, "--save", tmp_path / "b.json",
        timeout=1200, env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, "MEGAMOE_ENGINE": "sglang==0.5.23"})
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["engine"] == "sglang==0.5.23"
    rows = {(row["shape"], row["form"]): row for row in result["rows"]}
    assert sorted(rows) == [(s, f) for s in ("node-l1", "slice-l2") for f in ("auto", "megamoe")], result["rows"]
    for row in rows.values():
        assert "ranks" in row, row.get("failed", row)
        (rank,) = row["ranks"]
        assert rank["model_class"] == "Qwen3MoeForCausalLM" and rank["kernel_tuples"], rank  # SGLang's SM90 build
        assert row["node_s"] >= rank["process_s"] > 0, row
        assert abs(rank["process_s"] - sum(rank["phases"].values())) < 0.01, row  # the phases cover it
        assert all(rank["phases"][p] > 0 for p in ("imports", "construct", "weights", "post")), row
        assert rank["weights_experts_s"] > 0 and rank["weights_rest_s"] > 0, row
    for shape in ("node-l1", "slice-l2"):
        auto, ours = rows[shape, "auto"]["ranks"][0], rows[shape, "megamoe"]["ranks"][0]
        assert auto["tensors"]["experts"] > 0 and ours["tensors"]["experts"] == 0  # the experts installed, not read
        assert ours["tensors"]["rest"] == auto["tensors"]["rest"] > 0
        assert ours["plugin_import_s"] > 0 and ours["plugin_register_s"] > 0 and ours["probe_calls"] >= 1
        assert ours["phases"]["plugin"] >= ours["plugin_import_s"]
        # SGLang's own load_plugins runs in every process: auto's is timed, the plugin left out
        assert "plugin_import_s" not in auto and auto["phases"]["plugin"] >= auto["engine_plugins_s"] > 0
        assert ours["probe_while_building"] is True and ours["probe_early_s"] > 0  # SGLang's build ran the probe
        assert ours["probe_s"] < ours["probe_early_s"]  # the install found it passed: its time is the build's
        assert ours["experts_on"] == auto["experts_on"] == ["cpu"]  # where they landed (a GPU's, on one)
        assert ours["staging_loaded"] and not ours["rest_staged"]  # read inside the harness's patch of sys.modules
    # SGLang's auto reads every expert tensor of the source, whatever the rank holds: two layers, twice one
    experts = {shape: rows[shape, "auto"]["ranks"][0]["tensors"]["experts"] for shape in ("slice-l2", "node-l1")}
    assert experts["slice-l2"] == 2 * experts["node-l1"]
    assert result["identical"] == {"slice-l2 rank 0": True, "node-l1 rank 0": True}
    sys.path.insert(0, str(BENCH))
    import report_boot
    import report_gains

    text = report_boot.section_of("boot-smoke", result)
    assert "Python + SGLang imports" in text and "postprocess_weights" in text and "vLLM" not in text
    assert "node-l1 rank 0: True" in text and "slice-l2 rank 0: True" in text
    found = [("boot-smoke", result)]
    start = report_gains.engine_start(found, report_boot.engine_of(result))
    assert "SGLang 0.5.23 `auto` s" in start and "`Qwen3MoeForCausalLM`" in start and "vLLM" not in start


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_bench_boot_smoke_in_vllm_033(tmp_path):
    """A whole start on the CPU: vLLM 0.33's real DeepseekV4ForCausalLM built and loaded through vLLM's
    own loader and through --load-format megamoe, every phase timed, the same kernel bytes both ways."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    path = os.pathsep.join([*map(str, ensure("vllm==0.33.0")), str(REPO), str(BENCH)])
    run("bench_boot.py", "--smoke", "--shapes", "node", "--work", tmp_path, "--save", tmp_path / "b.json",
        timeout=1200, env={"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path})
    result = json.loads((tmp_path / "b.json").read_text())
    rows = {row["form"]: row for row in result["rows"]}
    assert sorted(rows) == ["auto", "megamoe"], result["rows"]
    for row in rows.values():
        assert "ranks" in row, row.get("failed", row)
        (rank,) = row["ranks"]
        assert row["node_s"] >= rank["process_s"] > 0, row  # the node's time includes the interpreter's start
        assert abs(rank["process_s"] - sum(rank["phases"].values())) < 0.01, row  # the phases cover it
        assert rank["phases"]["construct"] > 0 and rank["phases"]["weights"] > 0, row
        assert rank["weights_experts_s"] > 0 and rank["weights_rest_s"] > 0, row
    auto, ours = rows["auto"]["ranks"][0], rows["megamoe"]["ranks"][0]
    assert auto["tensors"]["experts"] > 0 and auto["tensors"]["rest"] > 0  # vLLM read both kinds
    assert ours["plugin_import_s"] > 0 and ours["probe_calls"] >= 1  # the tool's fixed costs, timed
    assert ours["probe_while_building"] is True  # vLLM's model build ran the probe: the install found it passed
    assert ours["probe_early_s"] > 0  # and its own time on its thread is reported
    assert ours["rest_staged"] and not auto["rest_staged"] and ours["tensors"]["rest"] == auto["tensors"]["rest"]
    assert result["identical"] == {"node-l1 rank 0": True}  # every parameter's bytes, the experts' and the rest's
    sys.path.insert(0, str(BENCH))
    import report_boot

    text = report_boot.section_of("boot-smoke", result)
    assert "`megamoe`" in text and "`auto`" in text and "node-l1 rank 0: True" in text


def test_bench_recovery_smoke_and_its_report(tmp_path, monkeypatch):
    """Two ranks on the CPU: the lost slots from the store and a joiner's slots from the store are the
    bytes of the joiner's own way (the whole checkpoint read and transformed); the report renders them."""
    saved = tmp_path / "results" / "recovery-cpu" / "recovery.json"
    summary = last_json(run("bench_recovery.py", "--smoke", "--work", tmp_path / "work", "--save", saved))
    assert summary["identical"] is True and summary["ranks"] == 2
    assert {r["method"] for r in summary["rows"]} == {"recover_store", "recover_per_rank", "join_store",
                                                      "join_checkpoint"}
    assert all(len(r["rank_s"]) == 2 and r["node_s"] == max(r["rank_s"]) for r in summary["rows"])
    sys.path.insert(0, str(BENCH))
    import report_recovery

    monkeypatch.setattr(report_recovery, "RESULTS", tmp_path / "results")
    text = report_recovery.section()
    assert "| `recover_store` |" in text and "Same bytes as the joiner's own way: yes" in text
    assert report_recovery.summary()[0].startswith("experts lost with a failed rank")


def test_device_recovery_script_parses_and_runs_real_flags():
    subprocess.run(["bash", "-n", str(BENCH / "device_recovery.sh")], check=True)
    flags = set(re.findall(r"(--[a-z-]+)", (BENCH / "device_recovery.sh").read_text().split("run)")[1]))
    assert {"--work", "--layers", "--experts", "--ep-size", "--lost", "--rounds"} <= flags
    assert flags <= set(re.findall(r"(--[a-z-]+)", run("bench_recovery.py", "--help")))
