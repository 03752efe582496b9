"""Baton's C++ argmax (kernels/csrc/argmax.cpp) against torch.argmax."""
import pytest
import torch


@pytest.fixture(scope="module")
def argmax_rows(native_kernels):
    return torch.ops.baton.argmax_rows


def rows_with_edge_cases(width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(10, width, generator=generator)
    values[1, 0] = values[1, width - 1] = 100.0  # a tie far apart: the first wins
    values[2, width // 2] = values[2, min(width - 1, width // 2 + 16)] = 100.0  # a tie in one lane
    values[3, width - 1] = 100.0  # the best in the tail past the last whole lane group
    values[4] = float("-inf")  # nothing finite: index 0
    values[5] = 7.0  # all equal
    values[6, width // 3] = float("nan")  # a NaN beats any number
    values[7, width - 1] = float("nan")  # in the tail
    values[8, 0] = values[8, width - 1] = float("nan")  # the first NaN
    return values


@pytest.mark.parametrize("width", [1, 5, 16, 17, 512, 32003, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torch_argmax_ties_and_nans_included(argmax_rows, width, dtype):
    values = rows_with_edge_cases(width, seed=width).to(dtype)
    got = argmax_rows(values)
    assert got.dtype == torch.long
    assert torch.equal(got, values.argmax(dim=-1))


def test_rows_may_be_strided_and_one_thread_or_many_gives_the_same(argmax_rows):
    wide = rows_with_edge_cases(49152 + 64, seed=3).to(torch.bfloat16)
    rows = wide[:, 32:32 + 49152]  # row stride 49,216
    expected = rows.argmax(dim=-1)
    assert torch.equal(argmax_rows(rows), expected)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(argmax_rows(rows), expected)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused_by_name(argmax_rows):
    with pytest.raises(RuntimeError, match="unit column stride"):
        argmax_rows(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="width >= 1"):
        argmax_rows(torch.randn(3, 0))
    with pytest.raises(RuntimeError, match=r"\[rows, width\]"):
        argmax_rows(torch.randn(16))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        argmax_rows(torch.randint(0, 9, (2, 16)))
