"""``megamoe preload`` picks the engine whose daemons it starts from the conversion's manifest, or
``--engine``; an engine the conversion's placement is not for, or none known, is refused in one line
before any engine is imported."""

from __future__ import annotations

from cli_runs import run_cli


def one_line(done) -> str:
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


def test_an_engine_other_than_the_conversions_placement_is_refused(tiny_converted):
    line = one_line(run_cli("preload", "--model", tiny_converted, "--engine", "sglang", check=False))
    assert "converted for vllm's expert placement, not sglang's" in line
    assert "preload it with --engine vllm, or convert with --engine sglang" in line


def test_an_unknown_engine_is_refused(tiny_converted):
    line = one_line(run_cli("preload", "--model", tiny_converted, "--engine", "tgi", check=False))
    assert "--engine tgi: expected one of vllm, sglang" in line


def test_the_manifests_engine_is_the_default(tiny_converted):
    """A vLLM conversion goes to vLLM's daemons, whose refusals it then meets (redundant experts)."""
    line = one_line(run_cli("preload", "--model", tiny_converted, check=False))
    assert "vLLM's weight-cache daemon refuses EPLB" in line
