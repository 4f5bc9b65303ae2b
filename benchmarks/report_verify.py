"""The verify sections of docs/benchmarks.md (from benchmarks/results/verify.json and verify-numerics.json,
saved by benchmarks/bench_verify.py)."""

from __future__ import annotations

from common import gb, result, table


def summary() -> list[str]:
    """The verify row of the page's table of other figures."""
    v = result("verify.json")
    return ["`megamoe verify` of one rank (xxh3-128), warm", f"{v['ratio_verify_vs_read']:.2f}x the time of the read",
            "a plain read of the same files, one thread", f"CPU, {v['machine']['cpus']} cores; {gb(v['rank_bytes'])} GB",
            "[verify](#verify-vs-a-plain-read-of-the-same-rank)"]


def sections() -> str:
    return f"{verify_section(result('verify.json'))}\n{numerics_section(result('verify-numerics.json'))}"


def verify_section(v: dict) -> str:
    g = v["gb_per_s"]
    rows = [[name, f"{v[key] * 1e3:.0f}", f"{g[gkey]:.1f}"] for name, key, gkey in (
        ("plain read, one thread", "read_s", "read"),
        (f"plain read, {v['check_threads']} threads", "read_parallel_s", "read_parallel"),
        ("`megamoe verify --ranks R` (xxh3-128)", "verify_s", "verify"),
        ("`load_rank(verify=True)`, CPU", "load_rank_verify_s", "load_rank"),
        ("plain read + SHA-256", "sha256_s", "sha256"))]
    return f"""## Verify vs a plain read of the same rank

`benchmarks/bench_verify.py`: one rank ({gb(v['rank_bytes'])} GB in {v['files']} files) of a converted
Flash-dims checkpoint, warm page cache (the hash's worst case: cold, the disk sets the pace for
both), medians of {v['repeats']}, {v['machine']['cpus']} CPU cores.

{table(["", "ms", "GB/s"], rows)}

Verifying costs {v['ratio_verify_vs_read']:.2f}x a single-threaded read and {v['ratio_verify_vs_read_parallel']:.2f}x a
parallel one; a SHA-256 of the same bytes would cost {v['ratio_sha256_vs_read']:.1f}x. That is why the manifest's
checksum is xxh3-128 (an integrity check against corruption and truncation, not a defence
against an adversary: for that, pin the hub revision (a commit hash) and trust your storage).
"""


def numerics_section(n: dict) -> str:
    """``bench_verify.py --numerics``: verify's levels on a whole conversion, numerics included."""
    lv = n["levels"]
    rows = [[label, f"{lv[key]['seconds']:.1f}", str(lv[key]["numerics_checks"] or "-"),
             f"{lv[key]['s_per_check']:.1f}" if lv[key]["s_per_check"] else "-"] for label, key in (
        ("`megamoe verify OUT` (sizes, checksums)", "verify"),
        ("`... --source SRC` (every slot's bytes)", "source"),
        ("`... --source SRC --numerics` (every MoE layer once, the ranks in turn)", "numerics"),
        ("`... --numerics --numerics-every-rank` (every rank x layer)", "numerics_every_rank"))]
    per = lv["numerics"]["s_per_check"]
    return f"""### `verify --numerics` against the plain verify

`benchmarks/bench_verify.py --numerics`: a whole conversion, every rank, each level timed once
({n['preset']} dims H={n['hidden']}, I={n['intermediate']}, {n['weight_format']} experts;
{len(n['layers'])} MoE layers ({', '.join(n['layers'])}), {n['experts']} experts, EP {n['ep_size']};
{n['machine']['cpus']} CPU cores, a machine shared with other work; converting took {n['convert_s']:.1f} s).

{table(["", "seconds", "numerics checks", "s per check"], rows)}

A numerics check runs two local slots of a rank (its first and last) and the layer's shared expert,
so its cost does not grow with the experts per rank. A full DeepSeek-V4-Flash (43 MoE layers + 1 MTP)
at EP 8 has 44 checks by default: about {44 * per / 60:.0f} minutes at this machine's {per:.1f} s a check
(computed from the rows above, not run); `--device cuda` runs them on a GPU.
"""
