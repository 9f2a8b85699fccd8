"""Rows written into a tensor by index. On the host numpy writes their bytes: for the mid-sized writes
of a sparse decode step (a few thousand rows of 64 values) torch's ``index_fill_`` and ``index_put_``
took 3-7x as long (bench/RESULTS.md, "Where a 1M step's thread goes")."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def put_rows(x: Tensor, at: np.ndarray | tuple[np.ndarray, ...], rows: Tensor | None = None) -> None:
    """``x[at] = rows`` in place, or zeros where ``rows`` is None. ``at`` indexes x's leading
    dimensions: a numpy array, or a tuple of arrays that broadcast together."""
    on_host = x.device.type == "cpu" and x.stride(-1) == 1
    if on_host and rows is None:
        x.view(torch.uint8).numpy()[at] = 0                     # all-zero bytes: +0.0, as index_fill_ writes
    elif on_host and rows.device.type == "cpu" and rows.dtype == x.dtype:
        x.view(torch.uint8).numpy()[at] = rows.contiguous().view(torch.uint8).numpy()
    else:
        index = tuple(torch.from_numpy(np.asarray(i)).to(x.device) for i in (at if isinstance(at, tuple) else (at,)))
        x[index] = 0 if rows is None else rows.to(x.dtype)
