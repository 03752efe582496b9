#!/usr/bin/env python3
"""An F16 copy of a GGUF file: every quantized tensor widened, the metadata kept.

    scripts/gguf_f16.py SOURCE.gguf TARGET.gguf

What llama.cpp's `llama-quantize --allow-requantize SOURCE TARGET F16` makes, written
with the `gguf` package so that no llama.cpp tool is needed: 2-D and larger tensors of
any quantized or float type become F16 (the dequantized values, rounded once to F16);
1-D tensors (the norms) stay as they are (F32 in llama.cpp's files); every metadata key
is copied, `general.file_type` set to MOSTLY_F16. scripts/bench_peers.py --f16 serves
such a copy on both servers (issue 12's "an F16 copy of it"). The copy is written to a
temporary name beside TARGET and renamed into place, so a half-written file is never
taken for a whole one.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

ARCHITECTURE_KEY = "general.architecture"
FILE_TYPE_KEY = "general.file_type"


def widened(tensor) -> tuple[np.ndarray, bool]:
    """The tensor's values as the copy stores them, and whether they changed type."""
    if len(tensor.shape) < 2 or tensor.tensor_type == GGMLQuantizationType.F16:
        return tensor.data, False
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float16), True


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every key but the header's own and the architecture (the writer adds both), and the
    file type, set to MOSTLY_F16 whether the source named one or not."""
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in (ARCHITECTURE_KEY, FILE_TYPE_KEY):
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main_type, sub_type)
    writer.add_file_type(int(LlamaFileType.MOSTLY_F16))


def write_f16_copy(source: Path, target: Path) -> dict[str, int]:
    """Write the F16 copy of `source` to `target`; how many tensors were widened and kept."""
    reader = GGUFReader(source)
    if ARCHITECTURE_KEY not in reader.fields:
        raise ValueError(f"{source}: no {ARCHITECTURE_KEY} key: not a model GGUF")
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    writer = GGUFWriter(partial, arch=reader.fields[ARCHITECTURE_KEY].contents())
    counts = {"widened": 0, "kept": 0}
    try:
        copy_metadata(reader, writer)
        for tensor in reader.tensors:
            data, changed = widened(tensor)
            counts["widened" if changed else "kept"] += 1
            writer.add_tensor(tensor.name, data, raw_dtype=None if changed else tensor.tensor_type,
                              raw_shape=None if changed else tuple(reversed(tensor.shape.tolist())))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    counts = write_f16_copy(args.source, args.target)
    print(f"{args.target}: {counts['widened']} tensors widened to F16, {counts['kept']} kept", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
