"""Linear layers on the weight layout this device multiplies fastest.

On CPU with oneDNN, a bf16 `F.linear` re-lays-out its weight on every call; for the
small token counts of decode steps that costs as much as the multiply. `Linear` lays the
weight out once (oneDNN's blocked format) and multiplies with oneDNN directly, which
gives the same bits as `F.linear` at the same row count and is ~25% faster at decode sizes. Other devices and
dtypes keep the plain weight and `F.linear` (fp32 would change the summation order).

Where the CPU has AMX tiles and Baton's C++ kernels build, a bf16 `Linear` also keeps its
weight in the tiles' layout and multiplies calls of up to `FEW_ROWS` rows with
kernels/csrc/amx_linear.cpp: oneDNN spends ~25-35 us of dispatch on each such call, a
fixed cost that dominated the tiny model's decode steps. This keeps a second copy of each
weight, the price of not slowing the large-row calls (prefill chunks), where oneDNN's
blocking wins.

oneDNN builds (and JIT-compiles) a kernel for each row count it meets, ~0.5 ms per layer
on the tiny model: a prompt of a length not met before took 1.9x as long to prefill as
one of a length met. Calls of more than FEW_ROWS rows (prefill chunks, whose lengths
vary without end) are therefore padded to one of 8 row counts per octave (`row_bucket`,
at most 12.5 % more rows), so a serving engine soon holds every kernel it needs, and
`Linear.warm_up` builds them all before it serves.

Where oneDNN has no native bf16 (an AVX2-only CPU), a bf16 matmul would end in torch's
scalar GEMM (2.5-3.5 GFLOP/s at 32 rows, a tenth of an fp32 one on the same core). An
engine set to bfloat16 there keeps its bf16 activations, KV and results, but each CPU
`Linear` holds its weight widened to fp32 and multiplies in fp32 (`widened`): every bf16
value is exact in fp32 and oneDNN's bf16 kernels accumulate in fp32 too, so only the
summation order differs, at twice the weight's memory. `dtype = "auto"` picks float32 on
such a CPU and never needs it.

A weight that came from a GGUF file's quantized blocks (common/engine/gguf.py
WeightBlocks) can keep them for the AMX few-row calls instead of a bf16 copy
(`pack_weight_blocks`, kernels/csrc/amx_linear.cpp amx_block_linear): a decode step reads
each weight once from memory, and 4-bit blocks are 0.625 bytes a value against bf16's 2.
The results have the same bits as the bf16 copy's (the kernel widens each tile to the
bf16 value the loader rounds the block's float32 value to).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Rows up to which the AMX kernel beat oneDNN on every layer shape measured (tiny and
# small models' widths, 1 to 256 rows; at 256 oneDNN was ahead on the widest ones).
FEW_ROWS = 64
AMX_TILE_MULTIPLE = 32  # out and in features must be multiples of it
BUCKETS_PER_OCTAVE_LOG2 = 3  # 8 padded row counts between each power of two and the next


TILE_COLUMNS = 16  # output columns of one AMX tile
BLOCK_VALUES = 32  # values along K sharing a scale and a minimum: one tile's K


@dataclass(frozen=True)
class QuantizedBlocks:
    """A weight [N, K] as blocks: value = scale * q + minimum over each 32 values of K
    (common.engine.gguf.WeightBlocks, as torch tensors)."""

    q: torch.Tensor  # int8 [N, K]; 0..15 where bits is 4
    scale: torch.Tensor  # float16 [N, K / 32]
    minimum: torch.Tensor  # float16 [N, K / 32]
    bits: int  # 4 or 8

    @classmethod
    def from_arrays(cls, blocks: Any) -> QuantizedBlocks:
        """From numpy arrays of the same names (a WeightBlocks), sharing their memory."""
        return cls(torch.from_numpy(blocks.q), torch.from_numpy(blocks.scale), torch.from_numpy(blocks.minimum),
                   blocks.bits)

    @classmethod
    def stacked(cls, parts: list[QuantizedBlocks | None]) -> QuantizedBlocks | None:
        """The blocks of the weights' rows stacked (a fused qkv or gate_up); None unless
        every part has blocks. 4-bit values fit 8 bits, so a mix is 8-bit."""
        if not parts or any(part is None for part in parts):
            return None
        present = [part for part in parts if part is not None]
        return cls(torch.cat([part.q for part in present]), torch.cat([part.scale for part in present]),
                   torch.cat([part.minimum for part in present]), max(part.bits for part in present))


def pack_weight_blocks(blocks: QuantizedBlocks) -> torch.Tensor:
    """The uint8 [N / 16, K / 32, tile bytes] layout amx_block_linear reads: per tile (16
    columns x 32 K), the values per K pair in the tile row's order (column c's even and odd K
    at lanes 2c, 2c + 1; 8-bit: a byte a lane; 4-bit: lanes 0-15 in the low nibbles of 16
    bytes, lanes 16-31 in their high nibbles), then the 16 fp16 scales, the 16 fp16 minimums."""
    rows, cols = blocks.q.shape
    column_blocks, k_tiles = rows // TILE_COLUMNS, cols // BLOCK_VALUES
    # [column block, column, K tile, K pair, even/odd] -> [column block, K tile, K pair, lane]
    values = (blocks.q.reshape(column_blocks, TILE_COLUMNS, k_tiles, BLOCK_VALUES // 2, 2)
              .permute(0, 2, 3, 1, 4).reshape(column_blocks, k_tiles, BLOCK_VALUES // 2, 2 * TILE_COLUMNS))
    if blocks.bits == 4:
        lanes = values.to(torch.uint8)
        packed = lanes[..., :TILE_COLUMNS] | (lanes[..., TILE_COLUMNS:] << 4)
    else:
        packed = values.contiguous().view(torch.uint8)

    def per_tile(per_block: torch.Tensor) -> torch.Tensor:
        return (per_block.reshape(column_blocks, TILE_COLUMNS, k_tiles).permute(0, 2, 1).contiguous()
                .view(torch.uint8))

    return torch.cat([packed.reshape(column_blocks, k_tiles, -1), per_tile(blocks.scale),
                      per_tile(blocks.minimum)], dim=2).contiguous()


def row_bucket(rows: int) -> int:
    """The row count a oneDNN call of `rows` rows (more than FEW_ROWS) is padded to: the next
    multiple of 1/8 of the power of two at or below `rows`."""
    step = 1 << max(rows.bit_length() - 1 - BUCKETS_PER_OCTAVE_LOG2, 0)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count that `row_bucket` pads a call of FEW_ROWS + 1 to `max_rows` rows to."""
    buckets: list[int] = []
    rows = FEW_ROWS + 1
    while rows <= max_rows:
        buckets.append(row_bucket(rows))
        rows = buckets[-1] + 1
    return buckets


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT); without it (an AMD EPYC
    with AVX2 only, say) the reorder raises, and F.linear is what runs."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and onednn_bf16_native())


def needs_widening(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight that oneDNN cannot multiply natively: kept and multiplied in fp32."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not onednn_bf16_native()


def onednn_bf16_native() -> bool:
    """Whether oneDNN computes bf16 on this CPU natively (AVX-512 BF16, AMX, AVX-NE-CONVERT);
    where not, a bf16 matmul ends in torch's scalar GEMM (`dtype = "auto"` picks float32)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def amx_fits(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % AMX_TILE_MULTIPLE == 0 and in_features % AMX_TILE_MULTIPLE == 0


class Linear:
    """y = x Wᵀ + b for x [tokens, in]; holds W [out, in] in the layout it runs fastest in.

    `amx=True` (callers pass kernels.native.amx_available(...)) adds the AMX copy for few-row calls where
    the weight's shape fits the tiles: `blocks` (the quantized blocks `weight` was dequantized
    from, giving its very values) where given, else a bf16 copy."""

    __slots__ = ("weight", "bias", "out_features", "in_features", "prepacked", "widened", "amx_weight", "amx_bits",
                 "_amx_linear")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True,
                 amx: bool = False, blocks: QuantizedBlocks | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.amx_weight: torch.Tensor | None = None
        self.amx_bits = 16  # of each weight value the AMX copy holds
        self._amx_linear: Callable[..., torch.Tensor] | None = None  # set with amx_weight
        if amx and weight.dtype == torch.bfloat16 and amx_fits(weight):
            if blocks is not None and tuple(blocks.q.shape) == tuple(weight.shape):
                self.amx_weight, self.amx_bits = pack_weight_blocks(blocks), blocks.bits
                self._amx_linear = _block_linear(blocks.bits)
            else:
                self.amx_weight = torch.ops.baton.amx_pack_linear_weight(weight)
                self._amx_linear = torch.ops.baton.amx_linear.default
        self.prepacked = prepack and can_prepack(weight)
        self.widened = needs_widening(weight)
        # Only one oneDNN-side copy is kept: the prepacked one replaces the plain weight.
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        elif self.widened:
            self.weight = weight.float()
            self.bias = bias.float() if bias is not None else None
        else:
            self.weight = weight

    @torch.no_grad()
    def warm_up(self, max_rows: int) -> int:
        """Call the prepacked weight once with each padded row count up to `max_rows`, so
        that oneDNN builds each of its kernels now, not in some request's step (on the
        CPU development machine a serving worker's first prefill of a new bucket took
        ~60 ms instead of ~5); returns the calls made (none without a prepacked weight)."""
        if not self.prepacked:
            return 0
        buckets = row_buckets(max_rows)
        for rows in buckets:
            self(torch.zeros(rows, self.in_features, dtype=torch.bfloat16))
        return len(buckets)

    @property
    def layer_operand(self) -> tuple[torch.Tensor, int] | None:
        """The weight kernels/csrc/decode_layer.cpp multiplies calls of up to FEW_ROWS rows
        by, as this Linear does, and its `bits` there: 16 or the blocks' bits on AMX, 0 for
        the oneDNN prepacked weight; None where that op cannot (widened or torch's path)."""
        if self.amx_weight is not None:
            return self.amx_weight, self.amx_bits
        return (self.weight, 0) if self.prepacked else None

    @property
    def build_key(self) -> tuple:
        """What the kernels oneDNN builds for this Linear's calls depend on: shapes, types and
        the path, never the weight's values (oneDNN caches them by descriptor). Linears with
        equal keys share those kernels, so warming one up warms all of them."""
        return (self.out_features, self.in_features, self.prepacked, self.weight.dtype,
                None if self.bias is None else self.bias.dtype)

    @property
    def kernel(self) -> str:
        """What multiplies few-row calls: 'amx' (on bf16), 'amx-q4' or 'amx-q8' (on quantized
        blocks), 'onednn', 'widened' (bf16 in fp32, see the module's docstring) or 'torch'."""
        if self.amx_weight is not None:
            return "amx" if self.amx_bits == 16 else f"amx-q{self.amx_bits}"
        return "onednn" if self.prepacked else "widened" if self.widened else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._amx_linear is not None and x.shape[0] <= FEW_ROWS:
            return self._amx_linear(x, self.amx_weight, self.bias)
        if self.prepacked:
            rows = x.shape[0]
            padded = row_bucket(rows) if rows > FEW_ROWS else rows
            if padded == rows:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]
        if self.widened:
            return F.linear(x.float(), self.weight, self.bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def _block_linear(bits: int) -> Callable[..., torch.Tensor]:
    op = torch.ops.baton.amx_block_linear.default

    def block_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return op(x, packed, bits, bias)

    return block_linear
