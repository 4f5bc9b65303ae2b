#!/usr/bin/env python3
"""Regenerate docs/benchmarks.md and its plots from benchmarks/results/.

Every number on the page is read from what the benchmark scripts saved (JSON, logs, profiles); the
report_*.py modules write the sections. Rerun a benchmark with ``--save benchmarks/results/...``
(benchmarks/README.md gives each command), then this script.

    pip install -e '.[bench]'
    python benchmarks/make_report.py
    python benchmarks/make_report.py --no-plots --out /tmp/x/benchmarks.md   # text only (CI compares it)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import report_boot
import report_convert
import report_daemon
import report_gains
import report_load
import report_node
import report_node_sglang
import report_pin
import report_probe
import report_recovery
import report_startup
import report_store
import report_verify
from common import REPO

METHOD = """## Method

Written once here; each section says only what it adds to it.

- **The first call, in a fresh process.** An engine loads each rank once per start: every start-up
  figure is the first load in a new process, after its imports (timed apart), with its files
  touched by nothing else. The one section of repeated calls in one process says so.
- **Cold and warm page cache.** Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` (as root) before each
  measurement. Warm: the measurement's own files read twice just before it, so every warm figure
  starts from files read before and read again, whatever the step before it left in the page cache
  (the node section's last table shows what one read instead of two does).
- **The engine's own thread settings.** A vLLM 0.33 worker loads with its share of the node's CPUs
  (`startup_omp_num_threads`: the CPUs over the node's workers), then serves with one torch thread;
  the node benchmark's rank processes load with that share.
- **Every rank of a node at once.** One process per GPU, every one built and idle before any is
  released, all released together; a node's time runs from the release to its last rank's end. A
  figure from one rank alone says so, and is never the headline.
- **Forms interleaved.** Within a round the forms take turns (odd rounds in reverse order), so what
  drifts on the host hits each form alike; the tables give medians over the rounds, the saved JSON
  every round.
- **Ratios against baselines and limits run side by side.** Every ratio divides two figures of the
  same run on the same machine: the engine's own loading (vLLM 0.33's `--load-format auto`, or its own
  loading code for one rank) and the limits timed in the same rounds (cold: the disk's parallel read
  of the same bytes; warm: the page cache -> pinned -> device path). Machines of one kind differ in
  memory bandwidth and disk speed: figures from different runs are not compared.
- **The same bytes.** Every form's result is checked equal to the others': a checksum of what the
  kernel reads, per shape and rank.
"""

OTHERS = ("| what | figure | the baseline beside it | machine; shape | section |\n"
          "|---|---|---|---|---|")


def others() -> str:
    """One row per benchmark that times one rank alone or runs on the CPU."""
    rows = [module.summary() for module in (report_startup, report_daemon, report_store, report_probe,
                                            report_convert, report_verify)]
    rows += [row for row in (report_recovery.summary(),) if row]  # none until a run is saved
    return OTHERS + "\n" + "\n".join("| " + " | ".join(row) + " |" for row in rows)


def plot(path: Path) -> None:
    """benchmarks.png: convert against a copy (CPU), one rank's warm load (GPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    after, before, _, _ = report_convert.inputs()
    report_convert.plot(ax1, after, before)
    report_load.plot(ax2, report_load.inputs())
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def formats_section() -> str:
    """What ``gpu_load_formats.py`` printed on a GPU machine, per engine (``results/gpu-formats-*/ENGINE.log``):
    each format and form's one line, or the error that stopped the run before any format; SGLang's daemon
    over CUDA IPC (``*-weight-cache.log``: its JSON line); the GPU (``machine.txt``)."""
    parts = []
    for log in sorted((REPO / "benchmarks" / "results").glob("gpu-formats-*/*.log")):
        text = log.read_text()
        lines = (_daemon_lines(text) if log.name.endswith("-weight-cache.log") else
                 [line for line in text.splitlines() if line.split(":")[0].count(" ") == 1
                  and any(word in line for word in (": served,", ": FAILED:", ": NOT RUN:"))])
        if not lines:
            errors = [line for line in text.splitlines() if line and not line.startswith((" ", "Traceback"))]
            lines = [f"stopped before any format: {errors[-1] if errors else 'no output'}"]
        parts.append(f"`{log.parent.name}/{log.name}`{_machine(log.parent)}:\n\n" + "\n".join(f"- {line}" for line in lines))
    if not parts:
        return ""
    return ("## Load formats that need a GPU (gpu_load_formats.py)\n\nEach format reads a conversion (per-rank "
            "form, store) into the engine's real modules on the GPU, its experts compared byte for byte with the "
            "engine's own loading of the source:\n\n" + "\n\n".join(parts) + "\n")


def _daemon_lines(text: str) -> list[str]:
    """``gpu_sglang_weight_cache.py``'s result line, in words."""
    for line in text.splitlines():
        if line.startswith("{") and '"byte_exact"' in line:
            r = json.loads(line)
            verdict = "byte-exact with SGLang's own loading" if r["byte_exact"] else f"DIFFERS: {r['differ']}"
            return [f"SGLang's weight-cache daemon over CUDA IPC ({r['layers']} layers), mapped on "
                    f"{', '.join(r['mapped_on'])} in {r['map_seconds']:.3f} s: {verdict}"]
    return []


def _machine(folder: Path) -> str:
    """`` (GPU)`` from the run's ``machine.txt`` (nvidia-smi's CSV), where saved."""
    path = folder / "machine.txt"
    if not path.exists():
        return ""
    rows = [line.split(",") for line in path.read_text().splitlines()[1:2]]
    return f" ({rows[0][0].strip()})" if rows else ""


def page(startup_png: str, png: str) -> str:
    boot = report_boot.section()
    boot = f"{boot}\n" if boot else ""  # no section until a run is saved
    recovery = report_recovery.section()
    boot += f"{recovery}\n" if recovery else ""
    formats = formats_section()
    boot += f"{formats}\n" if formats else ""
    return f"""# Benchmarks

<!-- Generated by benchmarks/make_report.py from benchmarks/results/; edit that script, not this file. -->

## What a node gains

{report_gains.gains()}

## One rank alone, and the CPU

Never the headline: one rank's process with the node's other ranks idle, or a conversion on the CPU.

{others()}

![time vs checkpoint size]({png})

{METHOD}
## Reproduce

[benchmarks/README.md](../benchmarks/README.md) gives every benchmark's command, the machine it
needs and the folder its results land in; `python benchmarks/make_report.py` rewrites this page from
those folders. `make bench` runs the quick convert benchmark.

{report_node.section()}
{report_node_sglang.section()}
{boot}{report_pin.section()}
{report_startup.section(startup_png)}
{report_daemon.section()}
{report_store.section()}
{report_probe.section()}
{report_convert.sections()}
{report_verify.sections()}
{report_load.section()}"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--no-plots", action="store_true", help="write the text only (no matplotlib needed): CI checks "
                                                          "that docs/benchmarks.md is what the results give")
    args = p.parse_args(argv)
    out = Path(args.out)
    png, startup_png = out.with_suffix(".png"), out.with_name("startup.png")
    if not args.no_plots:
        plot(png)
        report_startup.plot(report_startup.load_all(), startup_png)
    out.write_text(page(startup_png.name, png.name))
    print(f"wrote {out}" + ("" if args.no_plots else f", {png} and {startup_png}"))


if __name__ == "__main__":
    main()
