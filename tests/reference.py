"""numpy's answer for a reduction across ranks, written apart from ringserve's own reduce ops so
that the tests compare the ring with something that could disagree."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def numpy_reduce(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """op over the ranks' arrays, elementwise; integer averages round toward negative infinity."""
    stack = np.stack(list(xs))
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    if op == "product":
        return stack.prod(axis=0, dtype=stack.dtype)
    total = stack.sum(axis=0, dtype=stack.dtype)
    if op == "sum":
        return total
    if total.dtype.kind == "f":
        return np.divide(total, total.dtype.type(len(xs)))
    return np.floor_divide(total, len(xs))


def numpy_adasum(vectors: Sequence[np.ndarray], parts: Sequence[int] | None = None) -> np.ndarray:
    """Adasum (Maleki et al.) of whole vectors on one process, by the tree of adjacent pairs:
    ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` per part, rounded to the dtype at each level."""
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    level = [np.asarray(v) for v in vectors]
    dtype = level[0].dtype
    bounds = np.cumsum([0, *(parts if parts is not None else [level[0].size])])
    while len(level) > 1:
        combined = []
        for a, b in zip(level[0::2], level[1::2], strict=True):
            out = np.empty_like(a)
            for lo, hi in itertools.pairwise(bounds):
                x, y = a[lo:hi].astype(np.float64), b[lo:hi].astype(np.float64)
                dot, xx, yy = np.dot(x, y), np.dot(x, x), np.dot(y, y)
                wx = 1.0 - dot / (2 * xx) if xx >= tiny else 1.0
                wy = 1.0 - dot / (2 * yy) if yy >= tiny else 1.0
                out[lo:hi] = (wx * x + wy * y).astype(dtype)
            combined.append(out)
        level = combined
    return level[0]
