"""The chunked reader of safetensors files (``serve/tensor_stream.py``): every tensor, named, typed
and shaped as the ``safetensors`` library reads it, byte for byte, in file order; bad files refused
in one line naming them."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megamoe_convert.errors import LoadError, MegamoeError
from megamoe_convert.serve import tensor_stream
from megamoe_convert.serve.tensor_stream import plan_chunks, stream_tensors


def _tensors() -> dict[str, torch.Tensor]:
    """Odd dtypes and sizes (BF16 of an odd count leaves the next F32 unaligned in the file), a
    scalar, empty tensors, and one tensor far larger than the test's chunk."""
    g = torch.Generator().manual_seed(0)
    raw = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)  # noqa: E731
    return {
        "a.bf16_odd": raw(2 * 7).view(torch.bfloat16),
        "b.f32_after_odd": torch.randn(3, 5, generator=g),
        "c.fp8": raw(33).view(torch.float8_e4m3fn).reshape(3, 11),
        "d.e8m0": raw(9).view(torch.float8_e8m0fnu),
        "e.empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "f.i64": torch.arange(-5, 6, dtype=torch.int64),
        "g.big": torch.randn(64, 257, generator=g).to(torch.bfloat16),  # 32 KiB: many chunks' worth
        "h.bool": torch.tensor([True, False, True]),
        "i.scalar": torch.tensor(3.5, dtype=torch.float16),
        "j.i8": raw(5).view(torch.int8),
        "k.empty_last": torch.empty(0, dtype=torch.float32),
    }


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture
def shards(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    first, second = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    save_file({n: tensors[n] for n in names[:6]}, first, metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[6:]}, second, metadata={"format": "pt"})
    return [first, second]


@pytest.mark.parametrize("chunk_bytes", [1, 100, 4096, 1 << 20])
def test_every_tensor_is_the_librarys_byte_for_byte_in_file_order(shards, chunk_bytes):
    got = list(stream_tensors(shards, "cpu", chunk_bytes=chunk_bytes))
    want = []
    for path in shards:
        with safe_open(path, framework="pt") as f:
            header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
            order = sorted(f.keys(), key=lambda n: header[n]["data_offsets"])
            want += [(n, f.get_tensor(n)) for n in order]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, t), (_, w) in zip(got, want, strict=True):
        assert t.dtype == w.dtype and t.shape == w.shape and t.is_contiguous(), name
        assert _as_bytes(t) == _as_bytes(w), name


def test_chunks_are_whole_tensors_of_at_most_the_chunk_size_or_one_larger_tensor(shards):
    for path in shards:
        chunks = plan_chunks(path, 1000)
        entries = [e for c in chunks for e in c.entries]
        assert entries == sorted(entries, key=lambda e: e.begin)  # every tensor once, in file order
        for c in chunks:
            assert c.end - c.begin <= 1000 or len(c.entries) == 1
    (big,) = [c for c in plan_chunks(shards[1], 1000) if c.entries[0].name == "g.big"]
    assert len(big.entries) == 1 and big.end - big.begin == 64 * 257 * 2


def test_tensors_are_views_of_their_chunk_and_stay_valid_after_the_next(shards):
    """Chunks are never reused: a tensor the consumer keeps keeps its bytes."""
    kept = list(stream_tensors(shards, "cpu", chunk_bytes=64))
    again = dict(stream_tensors(shards, "cpu"))
    assert all(_as_bytes(t) == _as_bytes(again[n]) for n, t in kept)


def test_a_bad_header_is_one_line_naming_the_file(shards, tmp_path):
    bad = tmp_path / "model-bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 12) + b'{"x": nope}' + b" ")
    with pytest.raises(MegamoeError) as caught:
        list(stream_tensors([shards[0], bad]))
    message = str(caught.value)
    assert str(bad) in message and "\n" not in message and "header" in message


def test_a_truncated_file_is_refused_before_any_tensor(shards):
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-10])
    stream = stream_tensors(shards)
    with pytest.raises(MegamoeError, match=f"^{shards[1]}: truncated"):
        next(stream)  # every header is checked before the first tensor


def test_a_file_that_cannot_be_read_is_one_line_naming_it(shards, monkeypatch):
    real_open = tensor_stream.os.open

    def refuse(path, flags, *args):
        if str(path) == str(shards[1]):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(tensor_stream.os, "open", refuse)
    with pytest.raises(LoadError, match=f"^{shards[1]}: cannot be read \\(Permission denied\\)$"):
        list(stream_tensors(shards))


def test_a_dtype_torch_lacks_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "f4.safetensors"
    header = json.dumps({"w": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 3)
    with pytest.raises(LoadError, match=f"^{path}: w: dtype F6_E2M3 has no torch dtype"):
        list(stream_tensors([path]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_bytes", [100, 1 << 20])
def test_on_a_gpu_every_tensor_is_on_the_device_and_the_librarys_bytes(shards, chunk_bytes):
    want = dict(stream_tensors(shards, "cpu"))
    got = list(stream_tensors(shards, "cuda", chunk_bytes=chunk_bytes))
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        assert t.device.type == "cuda" and t.dtype == want[name].dtype and t.shape == want[name].shape, name
        assert _as_bytes(t.cpu()) == _as_bytes(want[name]), name


def test_a_tensor_unaligned_in_its_file_is_a_copy_with_its_bytes(tmp_path):
    """A writer that packs tensors in the order given (as ``megamoe convert`` copies a source's) can
    leave an F32 at an offset no multiple of 4: it is handed out aligned, with the same bytes."""
    from megamoe_convert.source.safetensors_io import TensorSpec, encode_header

    odd, f32 = torch.arange(7, dtype=torch.bfloat16), torch.randn(2, 3)
    path = tmp_path / "packed.safetensors"
    header = encode_header([TensorSpec("odd", "BF16", (7,), 14), TensorSpec("f32", "F32", (2, 3), 24)])
    path.write_bytes(header + _as_bytes(odd) + _as_bytes(f32))
    got = dict(stream_tensors([path], chunk_bytes=1 << 20))
    assert torch.equal(got["odd"], odd) and torch.equal(got["f32"], f32)
    assert got["f32"].data_ptr() % 4 == 0


def test_a_read_that_fails_mid_stream_is_one_line_naming_its_file_alone(shards, monkeypatch):
    """An I/O error on the second file's data names that file, not the list of every file read."""
    from megamoe_convert.source import safetensors_io

    real_read = safetensors_io.read_into

    def failing(fd, offset, out, source=None):
        if str(source) == str(shards[1]):
            raise OSError(5, "Input/output error")
        return real_read(fd, offset, out, source)

    monkeypatch.setattr(tensor_stream, "read_into", failing)
    with pytest.raises(LoadError, match=f"^{shards[1]}: cannot be read \\(Input/output error\\)$"):
        list(stream_tensors(shards))
