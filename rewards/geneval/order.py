"""The order in which GenEval visits a class's detections: most confident first, ties as its numpy sorts them.

GenEval's ``evaluation/evaluate_images.py`` (djghosh13/geneval, line 232) orders a class's rows with
``np.argsort(scores)[::-1]``: numpy's default, unstable ``quicksort``, reversed. Ties decide which
boxes reach the colour and position checks (the shapes world, whose detections all score 1, is all
ties), and numpy's tie order is not part of its contract: GenEval pins numpy 1.23.1, whose argsort
is an introsort (insertion sort for up to 16 values, so stable there; median-of-3 quicksort
partitions above), while numpy 2 on x86 sorts with SIMD networks whose tie order differs even for 8
values. :func:`descending_order` reproduces numpy 1.23's ``argsort`` exactly, on any numpy, so a
verdict does not depend on the installed numpy or CPU. Checked against numpy 1.23.5 on arrays with
many ties (tests/test_geneval_scorer.py holds the digest of those orders).
"""

from __future__ import annotations

import math

import numpy as np

#: numpy's ``SMALL_QUICKSORT``: a range of more than this many + 1 values is partitioned again
_SMALL = 15


def _less(a: float, b: float) -> bool:
    """numpy's float ``LT`` for sorting: NaN sorts after every number."""
    return a < b or (b != b and a == a)


def _sift(v: list[float], idx: list[int], lo: int, top: int, n: int, tmp: int) -> None:
    """Sift ``tmp`` down from heap slot ``top`` of the heap ``idx[lo:lo + n]`` (slots numbered from 1, as numpy's)."""
    i, j = top, top << 1
    while j <= n:
        if j < n and _less(v[idx[lo + j - 1]], v[idx[lo + j]]):
            j += 1
        if not _less(v[tmp], v[idx[lo + j - 1]]):
            break
        idx[lo + i - 1], i, j = idx[lo + j - 1], j, j + j
    idx[lo + i - 1] = tmp


def _heapsort(v: list[float], idx: list[int], lo: int, n: int) -> None:
    """numpy's ``aheapsort`` on ``idx[lo:lo + n]`` (the introsort fallback past its depth limit)."""
    for top in range(n >> 1, 0, -1):
        _sift(v, idx, lo, top, n, idx[lo + top - 1])
    while n > 1:
        tmp = idx[lo + n - 1]
        idx[lo + n - 1] = idx[lo]
        n -= 1
        _sift(v, idx, lo, 1, n, tmp)


def numpy123_argsort(values) -> np.ndarray:
    """``np.argsort(values)`` as numpy 1.23 computes it (introsort ``aquicksort``), int64 [N], for a
    1-D float array ``values`` [N]."""
    v = [float(x) for x in np.asarray(values).reshape(-1)]
    num = len(v)
    idx = list(range(num))
    if num < 2:
        return np.asarray(idx, dtype=np.int64)
    stack: list[tuple[int, int, int]] = []
    pl, pr = 0, num - 1
    depth = 2 * int(math.floor(math.log2(num)))
    while True:
        if depth < 0:
            _heapsort(v, idx, pl, pr - pl + 1)
        else:
            while pr - pl > _SMALL:
                pm = pl + ((pr - pl) >> 1)  # median of three to idx[pm], then parked at pr - 1
                if _less(v[idx[pm]], v[idx[pl]]):
                    idx[pm], idx[pl] = idx[pl], idx[pm]
                if _less(v[idx[pr]], v[idx[pm]]):
                    idx[pr], idx[pm] = idx[pm], idx[pr]
                if _less(v[idx[pm]], v[idx[pl]]):
                    idx[pm], idx[pl] = idx[pl], idx[pm]
                vp = v[idx[pm]]
                pi, pj = pl, pr - 1
                idx[pm], idx[pj] = idx[pj], idx[pm]
                while True:
                    pi += 1
                    while _less(v[idx[pi]], vp):
                        pi += 1
                    pj -= 1
                    while _less(vp, v[idx[pj]]):
                        pj -= 1
                    if pi >= pj:
                        break
                    idx[pi], idx[pj] = idx[pj], idx[pi]
                idx[pi], idx[pr - 1] = idx[pr - 1], idx[pi]
                depth -= 1
                if pi - pl < pr - pi:  # the larger side waits on the stack
                    stack.append((pi + 1, pr, depth))
                    pr = pi - 1
                else:
                    stack.append((pl, pi - 1, depth))
                    pl = pi + 1
            for i in range(pl + 1, pr + 1):  # insertion sort of what is left
                vi, x = idx[i], v[idx[i]]
                j = i
                while j > pl and _less(x, v[idx[j - 1]]):
                    idx[j] = idx[j - 1]
                    j -= 1
                idx[j] = vi
        if not stack:
            break
        pl, pr, depth = stack.pop()
    return np.asarray(idx, dtype=np.int64)


def descending_order(scores) -> np.ndarray:
    """Row indices [N] (int64) of ``scores`` [N], most confident first, in GenEval's order
    (``np.argsort(scores)[::-1]`` under numpy 1.23: equal scores of up to 16 rows come last-row-first)."""
    return numpy123_argsort(scores)[::-1].copy()
