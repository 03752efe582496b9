"""scripts/gguf_f16.py: the F16 copy of a GGUF file that bench_peers --f16 serves, on real
files written with gguf-py and read back by gguf-py and by Baton's converter."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from common.engine.gguf import convert_gguf
from tests.common.engine.gguf_files import TinyGguf
from tests.scripts import load_script

gguf_f16 = load_script("gguf_f16")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.BF16])
def test_the_copy_widens_every_matrix_to_f16_and_keeps_the_rest(tmp_path: Path, qtype: Q) -> None:
    source = TinyGguf(qtype=qtype, tied=True).write(tmp_path / "model.gguf")
    counts = gguf_f16.write_f16_copy(source, tmp_path / "model.F16.gguf")

    before, after = gguf.GGUFReader(source), gguf.GGUFReader(tmp_path / "model.F16.gguf")
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    matrices = [t for t in before.tensors if len(t.shape) >= 2]
    assert counts == {"widened": len(matrices), "kept": len(before.tensors) - len(matrices)}
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert new.shape.tolist() == old.shape.tolist(), old.name
        old_values = gguf.quants.dequantize(old.data, old.tensor_type)
        if len(old.shape) >= 2:
            assert new.tensor_type == Q.F16, old.name
            assert np.array_equal(new.data, old_values.astype(np.float16)), old.name  # rounded once
        else:
            assert new.tensor_type == old.tensor_type == Q.F32 and np.array_equal(new.data, old.data), old.name
    assert after.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in before.fields.items():
        if name != "general.file_type" and not name.startswith("GGUF."):
            assert after.fields[name].contents() == field.contents(), name
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_baton_reads_the_copy_as_the_source_rounded_to_f16(tmp_path: Path) -> None:
    spec = TinyGguf(qtype=Q.Q4_1)
    source = spec.write(tmp_path / "model.gguf")
    copy = tmp_path / "model.F16.gguf"
    gguf_f16.write_f16_copy(source, copy)
    weights = load_file(convert_gguf(copy, tmp_path / "converted") / "model.safetensors")
    for name, expected in spec.expected().items():
        rounded = expected if expected.ndim == 1 else expected.astype(np.float16).astype(np.float32)
        assert np.array_equal(weights[name], rounded), name


def test_a_truncated_file_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    whole = TinyGguf(qtype=Q.Q8_0).write(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError):
        gguf_f16.write_f16_copy(tmp_path / "cut.gguf", tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "whole.gguf"]
