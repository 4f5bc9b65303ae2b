"""docs/benchmarks.md's section for ``bench_boot.py``: a whole node's start, process start to a
loaded model, ``--load-format megamoe`` against the engine's own ``auto`` (vLLM 0.33's, or SGLang
0.5.23's for ``--engine sglang`` runs), phase by phase."""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple, Sequence

from common import RESULTS, result, short_gpu, table
from report_fixed import fixed_table, reported

#: The phases a rank times, in order, and what each is.
PHASES = (("imports", "Python + vLLM imports"), ("plugin", "megamoe plugin import + register"),
          ("cuda", "CUDA context"), ("config", "engine config"), ("process_group", "process groups"),
          ("loader", "loader made"), ("construct", "model built on the GPU"), ("weights", "every weight"),
          ("post", "process_weights_after_loading"))


class Engine(NamedTuple):
    """How the report names a run's engine, its model, and the whole model the slopes are carried to."""

    name: str
    label: str
    model: str
    dims: str
    layers: int
    post: str


def engine_of(run: dict[str, Any]) -> Engine:
    """The run's engine (``"engine": "sglang==0.5.23"``; a run that saved none ran vLLM 0.33)."""
    name, _, version = run.get("engine", "vllm==0.33.0").partition("==")
    if name == "sglang":
        return Engine("SGLang", f"SGLang {version}", "Qwen3MoeForCausalLM", "Qwen3-235B-A22B's FP8 dims", 94,
                      "postprocess_weights")
    return Engine("vLLM", f"vLLM {version.removesuffix('.0')}", "DeepseekV4ForCausalLM", "Flash dims",
                  WHOLE_MODEL_LAYERS, "process_weights_after_loading")


def phases(engine: Engine) -> tuple[tuple[str, str], ...]:
    """:data:`PHASES`, their labels naming ``engine``."""
    names = {"imports": f"Python + {engine.name} imports", "post": engine.post,
             **({"plugin": "SGLang's load_plugins (megamoe: with the plugin's import and register)"}
                if engine.name == "SGLang" else {})}
    return tuple((key, names.get(key, label)) for key, label in PHASES)


def runs() -> list[tuple[str, dict[str, Any]]]:
    """Every saved run, ``results/boot-*/boot.json``, by folder name."""
    return [(p.parent.name, result(f"{p.parent.name}/boot.json")) for p in sorted(RESULTS.glob("boot-*/boot.json"))]


def cells(run: dict[str, Any]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """(shape, form, cache) -> the rows that ran (every round)."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in run["rows"]:
        if "node_s" in row:
            out.setdefault((row["shape"], row["form"], row["cache"]), []).append(row)
    return out


def slowest(rows: list[dict[str, Any]], key: str) -> float:
    """The median over rounds of the slowest rank's ``key`` (a phase, or a report field)."""
    return statistics.median(max(r["phases"][key] if key in r["phases"] else r.get(key, 0.0) for r in row["ranks"])
                             for row in rows)


def node_s(rows: list[dict[str, Any]]) -> float:
    return statistics.median(row["node_s"] for row in rows)


def shape_table(got: dict, shape: str, engine: Engine) -> str:
    """One shape: each form and cache's node time, its slowest rank's phases, the weight phase's split."""
    header = ["form", "cache", "rounds", "node s", *[label for _, label in phases(engine)], "experts s", "the rest s",
              "the rest's share of the weights"]
    rows = []
    for (s, form, cache), got_rows in sorted(got.items()):
        if s != shape:
            continue
        weights = slowest(got_rows, "weights")
        rest = slowest(got_rows, "weights_rest_s")
        rows.append([f"`{form}`", cache, len(got_rows), f"{node_s(got_rows):.2f}",
                     *[f"{slowest(got_rows, key):.3f}" for key, _ in phases(engine)],
                     f"{slowest(got_rows, 'weights_experts_s'):.2f}", f"{rest:.2f}",
                     f"{rest / weights:.0%}" if weights else ""])
    return table(header, rows)


#: DeepSeek-V4-Flash's MoE layers (``bench_boot.py --slice-layers``' default): the whole model the
#: node shape's per-layer slope is carried to.
WHOLE_MODEL_LAYERS = 44


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = slope * x + intercept`` through ``points`` (two distinct x at least)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    per = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return per, my - per * mx


def node_layers(shape: str) -> int | None:
    """The MoE layers of a node shape's name (``node-l4`` -> 4); ``None`` for another shape."""
    return int(shape.removeprefix("node-l")) if shape.startswith("node-l") else None


class Slope(NamedTuple):
    """The node shape's least-squares line: ``per`` seconds each MoE layer adds after the imports,
    ``base`` what the rest takes at no layer (config, the model's other parts), ``start`` the median
    spawn-and-imports time (no layer count changes it), from ``layers``."""

    per: float
    base: float
    start: float
    layers: list[int]

    def at(self, layers: int) -> float:
        return self.start + self.base + self.per * layers


def after_imports(row: dict[str, Any]) -> float:
    """The slowest rank's time after its imports: the part of the node's time the layers change
    (the imports, tens of seconds and noisy, are fitted apart so they do not drown the slope)."""
    return max(r["process_s"] - r["phases"]["imports"] for r in row["ranks"])


#: The fewest layer counts a per-layer slope is fitted through.
LEAST_COUNTS = 3


def slope(got: dict, form: str, cache: str, least: int = LEAST_COUNTS) -> Slope | None:
    """Least squares of the node shape's time after the imports on its MoE layers, from ``least`` layer
    counts at least; the imports' median beside it (see :class:`Slope`)."""
    cells_ = [(layers, rows) for (s, f, c), rows in got.items()
              if (layers := node_layers(s)) is not None and f == form and c == cache]
    if len({x for x, _ in cells_}) < least:
        return None
    per, base = fit_line([(x, statistics.median(after_imports(row) for row in rows)) for x, rows in cells_])
    start = statistics.median(row["node_s"] - after_imports(row) for _, rows in cells_ for row in rows)
    return Slope(per, base, start, sorted(x for x, _ in cells_))


def slice_rows(run: dict[str, Any], got: dict, form: str, cache: str) -> list[dict[str, Any]]:
    """The measured slice rows of the whole model's layers (one node of EP 4N) for a form and cache."""
    layers = engine_of(run).layers
    whole = {i["name"] for i in run["setup"] if i["name"].startswith("slice") and i["layers"] == layers}
    return [row for (s, f, c), rows in got.items() if s in whole and f == form and c == cache for row in rows]


def slopes(run: dict[str, Any], got: dict) -> str:
    """The per-layer slope of each form's node time, and the whole model's node time estimated from it
    (and, where the slice of the whole model ran, that measurement beside it)."""
    rows, whole_layers = [], engine_of(run).layers
    for cache in ("cold", "warm"):
        for form in ("auto", "megamoe"):
            fit = slope(got, form, cache)
            if not fit:
                continue
            measured = slice_rows(run, got, form, cache)
            rows.append([f"`{form}`", cache, ", ".join(map(str, fit.layers)), f"{fit.per:.3f}", f"{fit.base:.2f}",
                         f"{fit.start:.2f}", f"{fit.at(whole_layers):.1f}",
                         f"{statistics.median(r['node_s'] for r in measured):.1f}" if measured else "not run"])
    if not rows:
        return ""
    return (f"The node shape's start against its MoE layers, per form: a least-squares line of the slowest rank's "
            f"time after its imports (its slope the seconds each MoE layer adds, its intercept what no layer "
            f"costs: config, the model's other parts), and the spawn and imports apart (their median: no layer "
            f"count changes them). The {whole_layers}-layer column, spawn and imports + intercept + "
            f"{whole_layers} x slope, is an estimate from measured per-layer slopes, not a measurement; the "
            f"slice column is measured (one node of EP 4N: the whole model's layers, a quarter of the experts a "
            f"rank of the node shape holds).\n\n" +
            table(["form", "cache", "layers measured", "s per MoE layer", "s at 0 layers after imports",
                   "spawn and imports, s", f"{whole_layers} layers, s (estimate from measured per-layer slopes)",
                   f"slice of {whole_layers} layers, s (measured)"], rows))


def node_of(run: dict[str, Any]) -> str:
    """The node's GPUs (``4 x H200``), and its rank processes where they share them (``8 rank processes
    on 4 x H100``: a node of more GPUs as its disk and page cache see it)."""
    m = run["machine"]
    shared = f"{m['rank_processes']} rank processes on " if 0 < len(m["gpus"]) < m["rank_processes"] else ""
    return f"{shared}{gpus_of(run)}"


def node_kind(run: dict[str, Any]) -> str:
    """The node a run measured (``4 x H200, 64 CPUs``): runs on the same kind pool their node shapes."""
    return f"{node_of(run)}, {run['machine']['cpus']} CPUs"


def pooled(found: list[tuple[str, dict[str, Any]]], cache: str) -> dict[str, tuple[list[str], dict]]:
    """Node kind -> (the runs with node-shape starts in ``cache``, every such cell of theirs, rows together)."""
    out: dict[str, tuple[list[str], dict]] = {}
    for name, run in found:
        got = {key: rows for key, rows in cells(run).items() if node_layers(key[0]) is not None and key[2] == cache}
        if got:
            names, cells_ = out.setdefault(node_kind(run), ([], {}))
            names.append(name)
            for key, rows in got.items():
                cells_.setdefault(key, []).extend(rows)
    return out


def whole_model(found: list[tuple[str, dict[str, Any]]]) -> str:
    """:func:`engine_whole_model` for each engine's runs (vLLM's first)."""
    engines = sorted({engine_of(run) for _, run in found}, key=lambda e: e.name != "vLLM")
    texts = [engine_whole_model([(n, r) for n, r in found if engine_of(r) == e], e) for e in engines]
    return "\n\n".join(text for text in texts if text)


def engine_whole_model(found: list[tuple[str, dict[str, Any]]], engine: Engine) -> str:
    """One node holding every rank at the whole model's layers, estimated per node kind from the
    node shape's per-layer slopes over every run on that kind (two layer counts at least; fewer than
    :data:`LEAST_COUNTS` is said in the row)."""
    rows, layers = [], engine.layers
    for cache in ("cold", "warm"):
        for kind, (names, got) in pooled(found, cache).items():
            fits = {form: slope(got, form, cache, least=2) for form in ("auto", "megamoe")}
            if not all(fits.values()):
                continue
            auto, ours = fits["auto"], fits["megamoe"]
            assert auto and ours
            counts = sorted(set(auto.layers) & set(ours.layers))
            few = f" (fewer than {LEAST_COUNTS})" if len(counts) < LEAST_COUNTS else ""
            est = {form: fit.at(layers) for form, fit in (("auto", auto), ("megamoe", ours))}
            rows.append([kind, cache, f"{', '.join(map(str, counts))}{few}", f"{ours.per:.3f} / {auto.per:.3f}",
                         f"{est['megamoe']:.1f}", f"{est['auto']:.1f}",
                         f"{est['auto'] - est['megamoe']:.1f} s ({(est['auto'] - est['megamoe']) / est['auto']:.0%})",
                         ", ".join(f"`{n}`" for n in names)])
    if not rows:
        return ""
    lead = "" if engine.name == "vLLM" else f"{engine.label}'s `{engine.model}`: "
    return (f"{lead}One node holding every rank at all {layers} MoE layers: **an estimate from measured "
            f"per-layer slopes, not a measurement** (the node shape's slowest rank after its imports, a "
            f"least-squares line per form through the layer counts measured on that node kind, at "
            f"{layers} layers, plus the median spawn and imports of those starts):\n\n" +
            table(["node", "cache", "MoE layers measured", "s per MoE layer, `megamoe` / `auto`",
                   "`megamoe` s (estimate)", "`auto` s (estimate)", "sooner (estimate)", "runs"], rows))


def rest_table(got: dict, shapes: list[str], engine: Engine) -> str:
    """The non-expert weights' time (the weight phase less the routed experts, the slowest rank's,
    medians over rounds) under each form, side by side, where the megamoe rows say how they read it
    (runs of a ``bench_boot.py`` that did not are left as their shape tables give them)."""
    rows = []
    for shape in shapes:
        for cache in ("cold", "warm"):
            auto, ours = got.get((shape, "auto", cache)), got.get((shape, "megamoe", cache))
            if not auto or not ours or not reported(ours, "rest_staged"):
                continue
            a, m = slowest(auto, "weights_rest_s"), slowest(ours, "weights_rest_s")
            staged = all(r.get("rest_staged") for row in ours for r in row["ranks"])
            rows.append([shape, cache, f"{a:.2f}", f"{a / slowest(auto, 'weights'):.0%}", f"{m:.2f}",
                         "megamoe's staging ring" if staged else f"{engine.name}'s iterator",
                         f"{a / m:.2f}x" if m else ""])
    if not rows:
        return ""
    how = ("in large chunks through the experts' staging ring" if engine.name == "vLLM" else
           "after the experts' install, by the same iterator")
    return (f"The non-expert weights (attention, norms, embedding, head, shared experts: the weight phase less the "
            f"routed experts, the slowest rank's), read by {engine.name}'s own safetensors iterator under `auto` and, "
            f"under `megamoe`, {how}, fed to the same {engine.name} `load_weights`:\n\n" +
            table(["shape", "cache", "`auto` s", "`auto`: share of its weight phase", "`megamoe` s",
                   "`megamoe` read them through", "`auto` s / `megamoe` s"], rows))


def last_error_line(text: str) -> str:
    """A failed row's error: the last line of its rank's output, as it ended."""
    return text.strip().splitlines()[-1].strip().replace("`", "'") if text.strip() else "no output"


def gpus_of(run: dict[str, Any]) -> str:
    """The run's GPUs (``4 x H200``), or ``CPU`` for a smoke run."""
    gpus = run["machine"]["gpus"]
    return f"{len(gpus)} x {short_gpu(gpus[0])}" if gpus else "CPU"


def shape_label(run: dict[str, Any], info: dict[str, Any]) -> str:
    """What a shape of the run is: one node of a larger EP deployment (the slice) or one node holding
    every rank."""
    if info["name"].startswith("slice"):
        return f"one node of EP {info['ep_size']}: ranks 0-{run['machine']['rank_processes'] - 1}"
    return f"one node holds every rank (EP {info['ep_size']})"


def section_of(name: str, run: dict[str, Any]) -> str:
    m, engine = run["machine"], engine_of(run)
    got = cells(run)
    parts = [f"### {name}: {gpus_of(run)}, {m['cpus']} CPUs, {m['rank_processes']} rank processes, torch {m['torch']}"]
    for info in run["setup"]:
        shape = info["name"]
        parts.append(f"#### {shape_label(run, info)}, {info['layers']} MoE layers; source {info['source_bytes'] / 1e9:.1f} GB "
                     f"(non-expert {info['rest_bytes'] / 1e9:.2f} GB), conversion {info['converted_bytes'] / 1e9:.1f} GB")
        parts.append(shape_table(got, shape, engine))
        failed = [f"`{r['form']}` {r['cache']}: {last_error_line(r['failed'])}" for r in run["rows"]
                  if r["shape"] == shape and "failed" in r]
        parts += [f"Did not finish: {'; '.join(failed)}."] if failed else []
    names = [i["name"] for i in run["setup"]]
    parts += [text for text in (rest_table(got, names, engine), fixed_table(got, names), slopes(run, got)) if text]
    if run.get("skipped"):
        parts.append("Not run (the run's time budget): " + "; ".join(run["skipped"]) + ".")
    if run.get("invocations"):
        parts.append("Made of several invocations on the same machine: " + "; ".join(run["invocations"]) + ".")
    parts += [run["note"]] if run.get("note") else []
    every = any("rest_fingerprint" in r for row in run["rows"] for r in row.get("ranks", []))
    parts.append(f"Identical {'bytes of every parameter' if every else 'kernel bytes'} across forms: " +
                 ", ".join(f"{k}: {v}" for k, v in run["identical"].items()))
    return "\n\n".join(parts)


def section() -> str:
    """The section, or nothing while no run is saved."""
    found = runs()
    if not found:
        return ""
    intro = ("## A whole node's start: process start to a loaded model (bench_boot.py)\n\n"
             "`benchmarks/bench_boot.py` starts one process per GPU at once; each imports vLLM 0.33, makes "
             "the config `vllm serve` makes, vLLM's process groups (a world of one process, its EP rank set), the "
             "load format's loader, builds vLLM's real `DeepseekV4ForCausalLM` on its GPU (with `--load-format "
             "megamoe`, in runs that time the first call's imports, the plugin's subclass of it, as vLLM's registry "
             "gives it once the plugin is registered), loads every weight "
             "through the loader and runs `process_weights_after_loading`. Node time: from the first spawn to "
             "the last rank's end; phases: the slowest rank's, medians over rounds. The non-expert weights are "
             "BF16 (the checkpoint has no `quantization_config`: vLLM 0.33's FP8 configs need packages the GPU "
             "machine lacks), about twice the bytes of a real FP8 checkpoint's linears. Not timed (they need an "
             "SM100 GPU): the MegaMoE kernels' JIT and buffers, KV-cache sizing, CUDA graphs.")
    vllm = [(name, run) for name, run in found if engine_of(run).name == "vLLM"]
    sglang = [(name, run) for name, run in found if engine_of(run).name != "vLLM"]
    text = intro + "\n\n" + "\n\n".join(section_of(name, run) for name, run in vllm) if vllm else \
        "## A whole node's start: process start to a loaded model (bench_boot.py)"
    if sglang:
        text += "\n\n" + SGLANG_INTRO + "\n\n" + "\n\n".join(section_of(name, run) for name, run in sglang)
    return text + "\n"


#: What an ``--engine sglang`` run measured.
SGLANG_INTRO = ("`bench_boot.py --engine sglang`: the same with SGLang 0.5.23. Each rank process imports SGLang, "
                "(under `megamoe`) loads the plugin as SGLang loads plugins, makes SGLang's `ModelConfig`, its "
                "topology for `--moe-a2a-backend megamoe` with TP = EP, and `get_model_loader`'s loader, whose "
                "own `load_model` builds SGLang's real `Qwen3MoeForCausalLM` on its GPU (FP8 128x128 blocks, "
                "Qwen3-235B-A22B's dims at the layers named, a small vocabulary), loads every weight and "
                "post-processes (`build_sm90_mega_moe_experts_weights` for the experts). The source holds every "
                "expert of every layer (SGLang's `auto` reads them all). Not timed: the MegaMoE kernels' JIT "
                "and buffers, KV-cache sizing, CUDA graphs.")
