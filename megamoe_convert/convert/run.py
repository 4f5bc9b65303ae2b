"""``megamoe convert``: a checkpoint -> per-rank MegaMoE shards + non-expert shards + manifest.

The job is a list of *units*, each producing exactly one output file: a small file copy,
a non-expert shard, or one rank's shard of one MoE layer. Units run on a thread pool
(file I/O and torch kernels release the GIL); each streams its file in order, in chunks
of a few experts, so memory is bounded by ``workers x chunk`` whatever the checkpoint
size. Every file is written to a hidden temporary name and renamed when complete, then
recorded in a journal; a rerun skips journaled files whose size and checksum still match.
The manifest is written last and removed first: a directory without one is unfinished.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megamoe_convert import faults, interrupts
from megamoe_convert.convert.gather import (
    ExpertReader,
    SharedExpertCache,
    non_expert_units,
    rank_shard_unit,
    small_file_units,
)
from megamoe_convert.convert.plan import (
    ConvertOptions,
    Plan,
    Unit,
    index_text,
    make_placement,
    non_expert_index,
    select_layers,
    shard_units,
)
from megamoe_convert.devices import usable_device
from megamoe_convert.layout.identity import layout_identity
from megamoe_convert.layout.placement import parse_ranks
from megamoe_convert.output import rank_extras
from megamoe_convert.output.clearing import remove_named
from megamoe_convert.output.journal import is_done
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.preflight import check_before_converting
from megamoe_convert.output.resume import SOURCE_ROOT_KEY, OutputState, PartState, check_output_dir
from megamoe_convert.output.stamps import SourceWatch
from megamoe_convert.output.writer import FileRecord, write_json_atomic
from megamoe_convert.progress import NoProgress, Progress
from megamoe_convert.source.checkpoint import INDEX_NAME, Checkpoint
from megamoe_convert.source.safetensors_io import FileCache

# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

@dataclass
class Summary:
    out: str
    ep_size: int
    ranks: list[int]
    layers: list[str]
    files_written: int
    files_skipped: int
    bytes_written: int
    expert_bytes: int
    seconds: float
    shard: str | None = None  # "i/n" for a part of a split conversion
    merged: bool = False  # a part: whether it found all parts in OUT and merged them
    #: Seconds spent writing files (the rest: reading the plan, checking what is already done, the manifest).
    write_seconds: float = 0.0
    #: :meth:`manifest.Manifest.coverage` of what was converted (partial or servable).
    coverage: dict[str, Any] = field(default_factory=dict)

    @property
    def write_bytes_per_s(self) -> float:
        """Throughput of the files written by this run (files found already done do not count)."""
        return self.bytes_written / self.write_seconds if self.write_seconds > 0 else 0.0
    store: bool = False  # every logical expert once (no --ep-size): serves any EP size

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["out"] = str(Path(self.out).resolve())
        data["seconds"], data["write_seconds"] = round(self.seconds, 3), round(self.write_seconds, 3)
        data["gb_per_s"] = round(self.write_bytes_per_s / 1e9, 3)
        data["partial"], data["servable"] = bool(self.coverage.get("partial")), bool(self.coverage.get("servable"))
        return data


def build_plan(src: Path, out: Path, options: ConvertOptions, files: FileCache,
               cancelled: threading.Event) -> Plan:
    ckpt = Checkpoint.open(src)
    placement = make_placement(ckpt, options)
    plan = Plan(ckpt, out, options, placement, parse_ranks(options.ranks, placement.ep_size),
                select_layers(ckpt, options.layers))
    rank_extras.check_global_scales(ckpt, files, plan.layers)  # NaN/inf/0/negative: refused before writing
    ckpt.check_block_scales(files, plan.layers)  # FP8 block scales: NaN/inf refused before writing
    plan.units.extend(small_file_units(plan))
    if not options.experts_only:
        plan.units.extend(non_expert_units(plan, files, cancelled))
    shared = SharedExpertCache.for_plan(plan)
    reader_factory = lambda: ExpertReader(ckpt, files, options.device, shared)  # noqa: E731
    for layer in plan.layers:  # layer-major: a layer's source bytes are read while hot
        for rank in plan.ranks:
            plan.units.append(rank_shard_unit(plan, reader_factory, rank, layer, cancelled))
    if options.shard is not None:
        plan.all_paths = [u.path for u in plan.units]
        plan.units = shard_units(plan, *options.shard, options.shard_by)
    return plan


def convert(src: Path | str, out: Path | str, options: ConvertOptions,
            progress: Progress | None = None) -> Summary:
    """Run (or resume) a conversion. Raises on any problem; OUT then has no manifest."""
    src, out = Path(src), Path(out)
    progress = progress or NoProgress()
    usable_device(options.device, "--device")
    cancelled = threading.Event()
    started = time.perf_counter()
    with FileCache() as files, _one_torch_thread():
        plan = build_plan(src, out, options, files, cancelled)
        watch = SourceWatch(plan.source_paths(), {n: h.file_size for n, h in plan.ckpt.headers.items()})
        check_output_dir(out, source=plan.ckpt.root)
        state = make_state(plan)
        with state.locked():
            summary = _run_locked(plan, state, progress, cancelled, started, watch)
    if options.shard is not None and options.auto_merge:
        from megamoe_convert.convert.fleet import (
            auto_merge,  # the last part to finish in a shared OUT writes the manifest
        )
        summary.merged = auto_merge(out, fsync=options.fsync)
    return summary


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch ops on one thread each while converting: the worker pool is the parallelism, and
    intra-op threads (a team for every worker thread that calls torch) only oversubscribe the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _in_background(make: Callable[[], Any]) -> Future[Any]:
    """``make()`` on its own thread, beside the units (the manifest's layout identity: a fixed cost
    that would otherwise run after the last file)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-manifest")
    future = pool.submit(make)
    pool.shutdown(wait=False)
    return future


def make_state(plan: Plan) -> OutputState:
    if plan.options.shard is None:
        return OutputState(plan.out, plan.options.fsync)
    index, count = plan.options.shard
    shard = {"index": index, "count": count, "by": plan.options.shard_by}
    return PartState(plan.out, shard, [u.path for u in plan.units], plan.options.fsync)


def _run_locked(plan: Plan, state: OutputState, progress: Progress, cancelled: threading.Event,
                started: float, watch: SourceWatch) -> Summary:
    out = plan.out
    check_before_converting(plan, state)  # journal readable, no link on the way, room on the disk
    # Refuses (a different plan, a changed source) before anything is touched.
    source = {**plan.source_stamp(), SOURCE_ROOT_KEY: str(plan.ckpt.root.resolve())}  # the SRC a resume hint names
    state.prepare(plan.fingerprint(), plan.options.overwrite, source)
    remove_named(out, [MANIFEST_NAME])  # from here on, OUT is visibly unfinished
    state.remove_partials()
    journal = state.journal()
    records: dict[str, FileRecord] = {}
    todo: list[Unit] = []
    progress.start(sum(u.nbytes for u in plan.units), len(plan.units))
    for unit in plan.units:
        if is_done(out, journal.get(unit.path)) and (unit.content is None
                                                     or (out / unit.path).read_bytes() == unit.content):
            records[unit.path] = journal[unit.path]
            progress.advance(unit.nbytes, unit.path, skipped=True)
        else:
            todo.append(unit)
    shard = plan.options.shard
    dims = plan.ckpt.dims
    layout = None if shard is not None else _in_background(lambda: layout_identity(
        dims.format, dims.hidden_size, dims.moe_intermediate_size, dims.shared_intermediate_size))
    writing = time.perf_counter()
    written = _run_units(todo, state, records, progress, cancelled, plan.options.worker_count())
    write_seconds = time.perf_counter() - writing
    watch.check()  # every source byte was read: were they the bytes of one unchanged source?
    if layout is None:  # a part: its own part manifest; `megamoe merge` writes index and manifest
        from megamoe_convert.convert.fleet import write_part_manifest
        write_part_manifest(plan, records)
    else:
        index = non_expert_index(plan)
        extra = [] if index is None else [
            write_json_atomic(out / INDEX_NAME, index_text(index), fsync=plan.options.fsync)]
        manifest = plan.manifest(records, extra)
        manifest.layout = layout.result()
        write_json_atomic(out / MANIFEST_NAME, manifest.dumps(), fsync=plan.options.fsync)
    return Summary(str(out), plan.placement.ep_size, plan.ranks, [layer.key for layer in plan.layers],
                   files_written=len(todo), files_skipped=len(plan.units) - len(todo), bytes_written=written,
                   expert_bytes=sum(u.nbytes for u in plan.units if u.kind == "experts"),
                   seconds=time.perf_counter() - started, shard=f"{shard[0]}/{shard[1]}" if shard else None,
                   store=plan.options.store, write_seconds=write_seconds, coverage=_coverage(plan))


def _coverage(plan: Plan) -> dict[str, Any]:
    return Manifest(source={}, dims=plan.ckpt.dims, placement=plan.placement, ranks=plan.ranks, layers=plan.layers,
                    experts_only=plan.options.experts_only, source_layers=[layer.key for layer in plan.ckpt.layers],
                    store=plan.options.store).coverage()


def _run_units(units: list[Unit], state: OutputState, records: dict[str, FileRecord], progress: Progress,
               cancelled: threading.Event, workers: int) -> int:
    written = 0

    def run(unit: Unit) -> FileRecord:
        record = unit.run()
        state.record(record)
        faults.committed_file()
        return record

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megamoe")
    try:
        futures = {pool.submit(run, u): u for u in units}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION, timeout=0.5)
            interrupts.check()  # a Ctrl-C whose KeyboardInterrupt Python dropped (raised in a finalizer)
            for future in done:
                record = future.result()  # re-raises the first failure
                records[record.path] = record
                written += record.size
                progress.advance(futures[future].nbytes, record.path, skipped=False)
    except BaseException:
        cancelled.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return written
