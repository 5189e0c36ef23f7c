"""braid's GGUF header reader (`braid.loader.gguf_file`) against the `gguf` package's
`GGUFReader` on a file holding every metadata type and the tensor types braid reads."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from braid.errors import UserError
from braid.loader.gguf_file import GGUFFileIndex


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "every-type.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 1 << 60)
    writer.add_int64("t.i64", -(1 << 60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo <｜User｜>")
    writer.add_array("t.strings", ["a", "", "ü", "<s>"] * 50)
    writer.add_array("t.ints", list(range(-5, 300)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((4, 8)).astype(np.float16))
    writer.add_tensor("plain.i32", np.arange(7, dtype=np.int32))
    blocks = quantize(rng.standard_normal((6, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.q8_0", blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    stacked = quantize(rng.standard_normal((2, 3, 64), dtype=np.float32),
                       GGMLQuantizationType.Q4_0)  # experts stacked: a 3-D tensor
    writer.add_tensor("blocks.q4_0", stacked, raw_dtype=GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_index_reads_what_gguf_reader_reads(gguf_file):
    reader, index = GGUFReader(gguf_file), GGUFFileIndex(gguf_file)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    # GGUFReader's `contents()` flattens an array of arrays; the file holds them nested
    assert expected.pop("t.nested") == [1, 2, 3]
    assert index.fields.pop("t.nested") == [[1, 2], [3]]
    assert index.fields == expected
    assert {k: type(v) for k, v in index.fields.items()} == {
        k: type(v) for k, v in expected.items()}
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert (ours.data_offset, ours.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


def test_a_truncated_or_foreign_file_is_named(gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = gguf_file.read_bytes()
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(UserError, match="tensor blocks.q4_0 ends past the end of the file"):
        GGUFFileIndex(cut)
    cut.write_bytes(data[:200])
    with pytest.raises(UserError, match="ends"):
        GGUFFileIndex(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UserError, match="is not a GGUF file"):
        GGUFFileIndex(other)
