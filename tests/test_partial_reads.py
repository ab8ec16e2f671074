"""A load at another world size reads part of each stored chunk: the rows it needs land in the
destination straight from the file when they are one run of its bytes (no ``torch.load`` of
the whole chunk), and through the decoder when they are not. Which boxes are one run decides
which bytes are read, so it is checked here against ``narrow`` on every box of small tensors;
the multi-rank loads of ``test_reshard`` check the bytes that land."""

from __future__ import annotations

import itertools

import torch

from tierstore.format.item_io import _contiguous_slice


def boxes(sizes):
    """Every box (offsets, lengths) of a tensor of ``sizes``."""
    per_dim = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in sizes]
    for combo in itertools.product(*per_dim):
        yield tuple(o for o, _ in combo), tuple(n for _, n in combo)


def test_a_box_is_one_run_exactly_when_its_bytes_are_contiguous_and_the_run_is_its_bytes():
    for sizes in [(5,), (4, 3), (3, 2, 4), (1, 3, 2)]:
        whole = torch.arange(torch.Size(sizes).numel(), dtype=torch.int32).reshape(sizes)
        raw = whole.numpy().tobytes()
        runs = strided = 0
        for offsets, lengths in boxes(sizes):
            box = whole
            for d, (o, n) in enumerate(zip(offsets, lengths)):
                box = box.narrow(d, o, n)
            run = _contiguous_slice(sizes, offsets, lengths, 4)
            if box.is_contiguous():
                assert run is not None, (sizes, offsets, lengths)
                start, length = run
                assert raw[start:start + length] == box.numpy().tobytes(), (sizes, offsets)
                runs += 1
            else:
                assert run is None, (sizes, offsets, lengths)
                strided += 1
        assert runs and (strided or len(sizes) == 1)


def test_rows_of_a_saved_chunk_are_one_run_and_columns_are_not():
    assert _contiguous_slice((8, 1024), (4, 0), (2, 1024), 4) == (4 * 1024 * 4, 2 * 1024 * 4)
    assert _contiguous_slice((8, 1024), (0, 0), (8, 1024), 2) == (0, 8 * 1024 * 2)
    assert _contiguous_slice((8, 1024), (0, 512), (8, 512), 4) is None
    assert _contiguous_slice((8, 1024), (0,), (8,), 4) is None  # not a box of this chunk
