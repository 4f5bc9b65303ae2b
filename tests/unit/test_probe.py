"""The layout probe's engine-agnostic half: the synthetic expert, the project's layout of it (the bytes a
conversion writes), the comparison, the fingerprint and layout identity (``output/layout_identity.py``),
the once-per-process run, the opt-out and the scratch twin (``engines/probe.py``).
The engines' own code runs the probe in ``tests/engines``."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from megamoe_convert import load_rank
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.engines import probe
from megamoe_convert.errors import InstallError, SettingError
from megamoe_convert.layout import identity
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.safetensors_io import FileCache
from megamoe_convert.synth.write import synthesize

#: A synth preset of a family whose checkpoints come in each format (FP8 block experts: Qwen3-MoE's).
PRESETS = {name: "qwen3-moe-tiny" if identity.kernel_of(fmt) == "sm90" else "tiny"
           for name, fmt in formats.FORMATS.items()}


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.forget()
    yield
    probe.forget()


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_the_synthetic_expert_is_the_checkpoint_form_of_its_format_and_the_same_for_a_seed(name):
    fmt = formats.FORMATS[name]
    inp = identity.synthetic_expert(fmt, 256, 128, 256 if fmt.fuses_fp8_shared else 0)
    again = identity.synthetic_expert(fmt, 256, 128, 256 if fmt.fuses_fp8_shared else 0)
    other = identity.synthetic_expert(fmt, 256, 128, 256 if fmt.fuses_fp8_shared else 0, seed=identity.PROBE_SEED + 1)
    for (proj, kind), shape in formats.checkpoint_byte_shapes(fmt, 256, 128).items():
        t = inp.routed[proj, kind]
        raw = t.reshape(-1).view(torch.uint8)
        assert raw.numel() == shape[0] * (shape[1] if len(shape) > 1 else 1)
        assert torch.equal(raw, again.routed[proj, kind].reshape(-1).view(torch.uint8))
        if kind == "weight":
            assert t.dtype == identity.CHECKPOINT_DTYPES[fmt.checkpoint_weight_dtypes[0]]
            assert not torch.equal(t.view(torch.uint8), other.routed[proj, kind].view(torch.uint8))
            if fmt.element != "e2m1":  # finite values: an engine may move them as floats
                assert torch.isfinite(t.float()).all()
    if fmt.global_scales:
        assert float(inp.routed["w1", "weight_scale_2"]) == float(inp.routed["w3", "weight_scale_2"]) > 0


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_the_probe_input_and_its_reference_are_made_on_the_cpu_whatever_the_default_device(name):
    """vLLM builds and loads its model under ``with torch.device(...)``: the probe must not follow it."""
    fmt = formats.FORMATS[name]
    shared = 256 if fmt.fuses_fp8_shared else 0
    plain = identity.synthetic_expert(fmt, 256, 128, shared)
    with torch.device("meta"):
        inp = identity.synthetic_expert(fmt, 256, 128, shared)
        ref = identity.reference(inp)
    for key, t in inp.routed.items():
        assert t.device.type == "cpu"
        assert torch.equal(t.reshape(-1).view(torch.uint8), plain.routed[key].reshape(-1).view(torch.uint8))
    for key, t in identity.reference(plain).items():
        assert ref[key].device.type == "cpu" and torch.equal(ref[key], t)


def test_the_probe_input_is_pcg64s_raw_stream_little_endian():
    """Every recorded fingerprint rests on these bytes: NumPy keeps a bit generator's raw stream the same
    across releases, so the input is that stream read as little-endian words, whatever the machine."""
    import numpy as np

    words = np.random.PCG64(identity.PROBE_SEED).random_raw(3)
    want = b"".join(int(w).to_bytes(8, "little") for w in words)
    stream = identity.RandomBytes(identity.PROBE_SEED)
    assert bytes(stream.take(2, 5).reshape(-1).tolist()) == want[:10]
    assert bytes(stream.take(8).tolist()) == want[16:24]  # the next word: a cut word's rest is not reused
    assert identity.RandomBytes(identity.PROBE_SEED).take(4).tolist() == list(want[:4])
    floats = identity.RandomBytes(identity.PROBE_SEED).uniform(1000)
    assert floats.dtype == torch.float32 and 0 <= float(floats.min()) and float(floats.max()) < 1
    low = identity.RandomBytes(identity.PROBE_SEED).between(64, 191, 1000)
    assert int(low.min()) >= 64 and int(low.max()) <= 190 and low.dtype == torch.uint8


def test_probe_dims_keep_each_dims_residue_and_stay_within_a_period():
    assert identity.probe_dims(4096, 2048, 2048) == (1024, 1024, 1024)
    assert identity.probe_dims(2304, 7168, 0) == (256, 1024, 0)
    assert identity.probe_dims(512, 384, 640) == (512, 384, 640)


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_the_reference_is_the_bytes_a_conversion_writes(tmp_path, name):
    """The probe's reference for one real checkpoint expert is that expert's slot in the rank files."""
    src, out = tmp_path / "src", tmp_path / "out"
    synthesize(src, PRESETS[name], experts=4, layers=1, mtp_layers=0, seed=7, weight_format=name)
    convert(src, out, ConvertOptions(ep_size=2, engine="sglang" if PRESETS[name] != "tiny" else "vllm"))
    ckpt = Checkpoint.open(src)
    layer, dims, files = ckpt.layers[0], ckpt.dims, FileCache()
    routed = {(proj, kind): files.read(ckpt.expert_entry(layer, 0, proj, kind))
              for proj, kind in formats.checkpoint_byte_shapes(dims.format, dims.hidden_size,
                                                               dims.moe_intermediate_size)}
    routed.update({key: value.view(torch.float32).reshape(())
                   for key, value in routed.items() if len(value.shape) == 1})
    shared = {(proj, kind): files.read(ckpt.shared_entry(layer, proj, kind))
              for proj in ("w1", "w2", "w3") for kind in ("weight", "scale")} if dims.shared_intermediate_size else {}
    inp = identity.ProbeInput(dims.format, dims.hidden_size, dims.moe_intermediate_size, dims.shared_intermediate_size,
                           routed, shared)
    written = next(iter(load_rank(out, 0).values())).tensors
    want = identity.reference(inp)
    assert set(want) <= set(written)
    for key, tensor in want.items():
        got = written[key] if key.startswith("shared_") or key == "l2_input_scale_all" else written[key][:1]
        if key == "l2_input_scale_all":
            got = got[:1]
        assert identity.difference(got, tensor) is None, key


def _permuted(tensors: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """The same tensors with two rows of ``key`` swapped: identical shapes, dtypes and strides."""
    out = dict(tensors)
    t = tensors[key].clone()
    t[:, [0, 1]] = t[:, [1, 0]]
    out[key] = t
    return out


def _laid_out_as_converted(inp, shapes):
    return identity.reference(inp)


def _engine(run, name="engine 1.0"):
    return probe.LayoutProbe(engine=name, where="model.layers.0.ffn.experts", run=run, contract="test contract")


def test_an_engine_laying_out_like_the_conversion_passes_once_per_process():
    calls = []

    def run(inp, shapes):
        calls.append(inp)
        return identity.reference(inp)

    first = probe.check_layout(_engine(run), formats.MXFP4, 4096, 2048)
    assert first == identity.layout_fingerprints(formats.MXFP4, 4096, 2048) and set(first) == {"routed"}
    assert probe.check_layout(_engine(run), formats.MXFP4, 4096, 2048) == first
    assert len(calls) == 1 and (calls[0].hidden, calls[0].inter) == (1024, 1024)
    probe.check_layout(_engine(run), formats.MXFP8, 4096, 2048)
    assert len(calls) == 2


def test_a_prepared_input_is_the_one_the_probe_uses_and_the_engine_gets_its_own_copy(monkeypatch):
    """:func:`probe.prepare` (a start's, while the engine builds the model) makes the input and its layout
    once; the install's probe then makes neither, and an engine that writes into its input changes
    nothing a later probe of the same input sees."""
    probe.prepare(formats.MXFP4, 4096, 2048)
    made = []
    monkeypatch.setattr(probe, "synthetic_expert", lambda *a, **k: made.append(a) or identity.synthetic_expert(*a, **k))
    monkeypatch.setattr(probe, "reference", lambda inp: made.append(inp) or identity.reference(inp))

    def scribbling(inp, shapes):
        out = identity.reference(inp)
        for t in inp.routed.values():
            t.view(torch.uint8).fill_(0)
        return out

    assert probe.check_layout(_engine(scribbling, "engine A"), formats.MXFP4, 4096, 2048) == \
        identity.layout_fingerprints(formats.MXFP4, 4096, 2048)
    assert probe.check_layout(_engine(_laid_out_as_converted, "engine B"), formats.MXFP4, 4096, 2048)
    assert made == []
    probe.check_layout(_engine(_laid_out_as_converted), formats.MXFP8, 4096, 2048)  # not prepared: made here
    assert len(made) == 2


@pytest.mark.parametrize("name", [n for n, f in formats.FORMATS.items() if f.fuses_fp8_shared])
def test_the_routed_part_alone_is_the_input_and_layout_made_without_a_shared_expert(name):
    fmt = formats.FORMATS[name]
    inp, laid_out = identity.routed_only(*probe.expected(fmt, 256, 128, 256))
    alone = identity.synthetic_expert(fmt, 256, 128, 0)
    assert inp.shared_inter == 0 and not inp.shared and inp.describe() == alone.describe()
    assert inp.routed.keys() == alone.routed.keys()
    for key, t in alone.routed.items():
        assert torch.equal(inp.routed[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    want = identity.reference(alone)
    assert laid_out.keys() == want.keys() and all(torch.equal(laid_out[k], want[k]) for k in want)


def test_a_prepared_input_with_a_shared_expert_serves_an_install_that_fuses_none(monkeypatch):
    """A start prepares the conversion's dims (its shared expert too); modules that fuse no shared expert
    probe the routed part alone, and the probe makes nothing for them either."""
    probe.prepare(formats.MXFP4, 4096, 2048, 2048)
    made = []
    monkeypatch.setattr(probe, "synthetic_expert", lambda *a, **k: made.append(a) or identity.synthetic_expert(*a, **k))
    monkeypatch.setattr(probe, "reference", lambda inp: made.append(inp) or identity.reference(inp))
    assert probe.check_layout(_engine(_laid_out_as_converted), formats.MXFP4, 4096, 2048) == \
        identity.layout_fingerprints(formats.MXFP4, 4096, 2048)
    assert made == []


def test_a_failed_preparation_is_not_kept(monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no memory")

    monkeypatch.setattr(probe, "synthetic_expert", failing)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no memory"):
            probe.prepare(formats.MXFP4, 512, 512)
    assert len(calls) == 2


def test_a_preparation_failing_while_the_probe_waits_is_made_again_by_the_probe(monkeypatch):
    """What the start's thread fails at, the install's probe waiting on it makes itself (and raises
    there if it fails there too), never the other thread's error."""
    import threading

    entered, release, calls = threading.Event(), threading.Event(), []

    def first_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            entered.set()
            release.wait(30)
            raise MemoryError("the start's thread ran out")
        return identity.synthetic_expert(*args, **kwargs)

    monkeypatch.setattr(probe, "synthetic_expert", first_fails)
    dims = identity.probe_dims(4096, 2048, 0)
    failed: list[str] = []

    def prepare() -> None:
        try:
            probe.prepare(formats.MXFP4, 4096, 2048)
        except MemoryError as e:
            failed.append(str(e))

    preparing = threading.Thread(target=prepare)
    preparing.start()
    assert entered.wait(30)
    got = []
    waiting = threading.Thread(target=lambda: got.append(probe.expected(formats.MXFP4, *dims)))
    waiting.start()
    pending = probe._expected[(formats.MXFP4.name, *dims)]
    deadline = time.monotonic() + 30
    while not pending._condition._waiters and time.monotonic() < deadline:  # the probe waits on it
        time.sleep(0.01)
    release.set()
    preparing.join(30)
    waiting.join(30)
    assert len(calls) == 2 and len(got) == 1
    assert failed == ["the start's thread ran out"]
    assert identity.fingerprints(got[0][1]) == identity.layout_fingerprints(formats.MXFP4, 4096, 2048)


def test_a_conversions_install_is_prepared_ahead_from_its_manifest(tiny_converted):
    """What an engine's model class starts before it builds the model: the install's imports and the
    probe's input for the conversion's dims, on a thread of its own."""
    from megamoe_convert.engines.load_formats import prepare_install
    from megamoe_convert.output.manifest import read_manifest

    dims = read_manifest(tiny_converted).dims
    prepare_install(str(tiny_converted), "megamoe_convert.engines.driver").join(timeout=120)
    key = (dims.format.name, *identity.probe_dims(dims.hidden_size, dims.moe_intermediate_size,
                                                  dims.shared_intermediate_size or 0))
    assert key in probe._expected and probe._expected[key].done()
    probe.forget()
    prepare_install("owner/not-a-local-folder", "megamoe_convert.engines.driver").join(timeout=120)
    assert probe._expected == {}


def test_an_engine_permuting_the_bytes_is_refused_in_one_line_naming_engine_tensor_and_what_to_do():
    def run(inp, shapes):
        return _permuted(identity.reference(inp), "l1_sf")

    for _ in range(2):  # a failure is not remembered: every install refuses
        with pytest.raises(InstallError) as e:
            probe.check_layout(_engine(run, "vLLM 9.9.9 (DeepGEMM 9.9)"), formats.MXFP4, 512, 512)
        message = str(e.value)
        assert "\n" not in message and message.startswith("vLLM 9.9.9 (DeepGEMM 9.9): ")
        assert "model.layers.0.ffn.experts l1.sf" in message and "first difference at element [0, 0, 0]" in message
        assert "do not serve this conversion" in message and "--load-format megamoe" in message


def test_an_engine_holding_another_view_or_leaving_a_tensor_unset_is_refused():
    def transposed(inp, shapes):
        out = identity.reference(inp)
        out["l2_sf"] = out["l2_sf"].contiguous()  # the same values, row-major instead of MN-major
        return out

    with pytest.raises(InstallError, match=r"l2\.sf .*strides"):
        probe.check_layout(_engine(transposed), formats.MXFP4, 512, 512)

    def partial(inp, shapes):
        out = identity.reference(inp)
        del out["l2_weight"]
        return out

    with pytest.raises(InstallError, match=r"l2\.weight .*left it unset"):
        probe.check_layout(_engine(partial), formats.MXFP4, 512, 512)


def test_an_engine_whose_code_cannot_run_the_probe_is_refused_naming_the_opt_out():
    def run(inp, shapes):
        raise ImportError("No module named 'deep_gemm'")

    with pytest.raises(InstallError) as e:
        probe.check_layout(_engine(run, "vLLM 0.32.0 (DeepGEMM absent)"), formats.MXFP4, 512, 512)
    message = str(e.value)
    assert "\n" not in message and "cannot run the engine's own loading code" in message
    assert "No module named 'deep_gemm'" in message and f"{probe.OPT_OUT_ENV}=0" in message


def test_a_conversion_recording_another_fingerprint_is_refused():
    recorded = identity.layout_fingerprints(formats.MXFP4, 512, 512, 512)
    assert set(recorded) == {"routed", "shared"}
    for part in recorded:
        with pytest.raises(InstallError, match=f"records {part} layout fingerprint .*written with another layout"):
            probe.check_layout(_engine(_laid_out_as_converted), formats.MXFP4, 512, 512, 512,
                               recorded={**recorded, part: "xxh3_64:0000000000000000"})
    assert probe.check_layout(_engine(_laid_out_as_converted), formats.MXFP4, 512, 512, 512,
                              recorded=recorded) == recorded
    # an engine that does not fuse the shared expert probes the routed experts only: the shared record is not asked
    routed = probe.check_layout(_engine(_laid_out_as_converted), formats.MXFP4, 512, 512, 0, recorded=recorded)
    assert routed == {"routed": recorded["routed"]}


def test_the_opt_out_is_explicit_and_logged(monkeypatch, caplog):
    monkeypatch.delenv(probe.OPT_OUT_ENV, raising=False)
    assert probe.enabled() and not probe.enabled(False) and probe.enabled(True)
    monkeypatch.setenv(probe.OPT_OUT_ENV, "0")
    assert not probe.enabled() and probe.enabled(True)
    monkeypatch.setenv(probe.OPT_OUT_ENV, "1")
    assert probe.enabled()
    monkeypatch.setenv(probe.OPT_OUT_ENV, "off")  # one spelling: a word is refused, not read as on
    with pytest.raises(SettingError, match="MEGAMOE_LAYOUT_PROBE='off': expected 0 \\(off\\) or 1 \\(on\\)"):
        probe.enabled()
    with caplog.at_level(logging.WARNING):
        probe.skipped("model.layers.0.ffn.experts")
    assert "layout probe skipped" in caplog.text and "unchecked" in caplog.text


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_the_layout_identity_names_the_transform_and_fingerprints_the_probes_input(name):
    fmt = formats.FORMATS[name]
    record = identity.layout_identity(fmt, 4096, 2048)
    assert record["transform"] == identity.TRANSFORMS[identity.kernel_of(fmt)] and record["seed"] == identity.PROBE_SEED
    assert record["input"] == identity.PROBE_INPUT
    assert record == identity.layout_identity(fmt, 4096, 2048)
    assert record["fingerprints"] != identity.layout_identity(fmt, 4096, 1920)["fingerprints"]
    assert set(record["proven"]) == {"vllm", "sglang", "deep_gemm"}


def test_fingerprints_differ_across_formats():
    prints = {identity.layout_fingerprints(fmt, 512, 512)["routed"] for fmt in formats.FORMATS.values()}
    assert len(prints) == len(formats.FORMATS)


class _Loader(nn.Module):
    """A module shaped like the engines' experts: parameters with a loader bound to the module, and
    bookkeeping the loader writes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 8, 2, dtype=torch.int32).transpose(1, 2), requires_grad=False)
        self.w.weight_loader = self.weight_loader
        self.seen = torch.zeros(4)
        self.pending = {}
        self.register_buffer("alpha", torch.ones(4))

    def weight_loader(self, param, loaded, slot):
        param.data[slot].copy_(loaded)
        self.seen[slot] = 1
        self.pending[slot] = True
        self.alpha[slot] = 5


def test_a_scratch_twin_runs_the_modules_own_loader_without_touching_the_module():
    module = _Loader()
    before = {k: v.clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}
    twin = probe.scratch_twin(module, {"w": probe.like(module.w, (1, 2, 8))})
    assert twin.w.stride() == (16, 1, 2) and twin.w.weight_loader.__self__ is twin
    twin.w.weight_loader(twin.w, torch.full((2, 8), 7, dtype=torch.int32), 0)
    assert bool((twin.w == 7).all()) and float(twin.seen[0]) == 1 and twin.pending == {0: True}
    assert float(twin.alpha[0]) == 5
    assert all(torch.equal(v, before[k]) for k, v in [*module.named_parameters(), *module.named_buffers()])
    assert float(module.seen.sum()) == 0 and module.pending == {}


def test_an_install_into_modules_whose_code_cannot_run_the_probe_is_refused_unless_opted_out(tiny_converted, caplog):
    """vLLM-shaped modules without vLLM's loading code (the plain suite's stand-ins): refused in one line
    naming the opt-out, nothing changed; with ``probe=False`` installed, and the skip logged."""
    from vllm_stand_in import STAND_INS, experts_of, stand_in_model

    from megamoe_convert.engines.vllm import install

    for cls in STAND_INS.values():
        model = stand_in_model(cls, 3)
        before = [t.clone() for m in experts_of(model) for t in m.parameters()]
        with pytest.raises(InstallError) as e:
            install(model, tiny_converted, rank=3)
        message = str(e.value)
        assert "\n" not in message and "cannot run the engine's own loading code" in message
        assert "probe=False" in message and f"{probe.OPT_OUT_ENV}=0" in message
        after = [t for m in experts_of(model) for t in m.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        with caplog.at_level(logging.WARNING):
            assert install(model, tiny_converted, rank=3, probe=False) == 3
        assert "layout probe skipped" in caplog.text
