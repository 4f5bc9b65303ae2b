"""Runs side by side, each in a process of its own: parts of a split conversion running at once,
writers of one output refused while another holds it, a source changed under a running conversion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, output_files, run_cli
from damage import CONVERT_ARGS, cli_cmd

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import MegamoeError
from megamoe_convert.serve.loader import load_rank

# ----------------------------------------------------------------------------- writers of one output

def start_held(ckpt: Path, out: Path, release: Path, *extra: object) -> subprocess.Popen:
    """A convert that holds its locks after committing one file, until ``release`` exists."""
    run = subprocess.Popen(cli_cmd("convert", ckpt, out, *CONVERT_ARGS, *extra), cwd=REPO, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "MEGAMOE_TEST_FAULTS": f"wait-after-files=1:{release}"})
    deadline = time.monotonic() + 60
    while not Path(f"{release}.waiting").exists():
        if time.monotonic() > deadline or run.poll() is not None:
            run.kill()
            pytest.fail(f"held convert did not start: {run.communicate()[1]}")
        time.sleep(0.05)
    return run


@pytest.mark.parametrize("held, intruder, message", [
    ((), ("convert",), "another `megamoe convert` or `megamoe merge` is writing this directory"),
    ((), ("convert", "--shard", "1/2"), "a `megamoe convert` without --shard or a `megamoe merge` is writing"),
    (("--shard", "0/2"), ("convert",), "part 0/2 of a split conversion is being written into this directory"),
    (("--shard", "0/2"), ("convert", "--shard", "0/2"), "part 0/2 is already being converted"),
])
def test_runs_that_would_interleave_in_one_output_are_refused(tiny_ckpt, tmp_path, clean, held, intruder, message):
    """Parts of one split conversion run side by side; nothing else runs beside a writer of OUT
    (a whole conversion deletes what parts write, and the reverse)."""
    out, release = tmp_path / "out", tmp_path / "release"
    first = start_held(tiny_ckpt, out, release, *held)
    second = run_cli(intruder[0], tiny_ckpt, out, *CONVERT_ARGS, *intruder[1:], check=False)
    assert second.returncode == 2 and message in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    release.touch()
    assert first.wait(timeout=120) == 0, first.stderr.read()
    if held:
        run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS, "--shard", "1/2")  # the last part merges them
    assert output_files(out) == clean[0]


# ----------------------------------------------------------------------------- a source changed under a run

def test_a_source_changed_during_the_run_fails_it(tiny_ckpt, tmp_path):
    src, out, release = tmp_path / "src", tmp_path / "out", tmp_path / "release"
    shutil.copytree(tiny_ckpt, src)
    proc = subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", "convert", src, out, "--ep-size", "2"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MEGAMOE_TEST_FAULTS": f"wait-after-files=2:{release}"})
    deadline = time.monotonic() + 120
    while not Path(f"{release}.waiting").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    before = shard.stat()
    with open(shard, "r+b") as f:  # in place, same size, mtime set back: only ctime and bytes tell
        f.seek(before.st_size - 1)
        last = f.read(1)[0]
        f.seek(before.st_size - 1)
        f.write(bytes([last ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    release.touch()
    assert proc.wait(timeout=120) == 2
    stderr = proc.stderr.read()
    assert "changed while it was being converted" in stderr and "Traceback" not in stderr
    assert not (out / "manifest.json").exists()


# ----------------------------------------------------------------------------- parts of a split conversion at once

EP4 = ("--ep-size", 4, "--num-redundant-experts", 4)


def options(shard: tuple[int, int] | None = None, by: str = "layer", **kw: object) -> ConvertOptions:
    return ConvertOptions(ep_size=4, num_redundant_experts=4, shard=shard, shard_by=by, fsync=False, **kw)


def start_cli(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "megamoe_convert.cli", *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str]) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    return json.loads(stdout)


def test_parts_in_separate_directories_then_merge_equal_a_single_machine_convert(tiny_ckpt, tiny_converted,
                                                                                 tmp_path):
    parts = [tmp_path / f"part{i}" for i in range(3)]
    procs = [start_cli("convert", tiny_ckpt, parts[i], *EP4, "--shard", f"{i}/3", "--json") for i in range(3)]
    summaries = [finish(p) for p in procs]
    assert [s["shard"] for s in summaries] == ["0/3", "1/3", "2/3"]
    assert not any(s["merged"] for s in summaries)  # each OUT holds one part only
    written = [set(output_files(p)) for p in parts]
    for i, part in enumerate(parts):
        assert not (part / "manifest.json").exists() and (part / f"manifest.part-0000{i}-of-00003.json").exists()
        with pytest.raises(MegamoeError, match="megamoe merge"):  # a part is never loadable on its own
            load_rank(part, 0)
    assert not (written[0] & written[1]) and not (written[1] & written[2])  # no file converted twice

    out = tmp_path / "merged"
    relative = [os.path.relpath(d, REPO) for d in (out, *parts)]  # run_cli runs in REPO
    result = json.loads(run_cli("merge", *relative, "--json").stdout)
    assert result["out"] == str(out.resolve())  # --json: absolute paths, whatever the command line said
    assert result["parts"] == 3 and result["verified"] == "checksum" and result["copied"] + result["linked"] == 15
    assert output_files(out) == output_files(tiny_converted)
    # OUT is now an ordinary conversion: the same single-machine command finds every file done.
    again = convert(tiny_ckpt, out, options())
    assert again.files_written == 0 and again.files_skipped == 15
    assert output_files(out) == output_files(tiny_converted)


def test_parts_running_at_once_into_one_shared_directory_merge_themselves(tiny_ckpt, tiny_converted, tmp_path):
    out = tmp_path / "shared"
    procs = [start_cli("convert", tiny_ckpt, out, *EP4, "--shard", f"{i}/2", "--shard-by", "rank", "--json")
             for i in range(2)]
    summaries = [finish(p) for p in procs]
    assert any(s["merged"] for s in summaries)  # the last part to finish wrote the manifest
    assert output_files(out) == output_files(tiny_converted)
    assert not list(out.glob("manifest.part-*"))  # consumed (kept under .megamoe/ for a re-merge)
