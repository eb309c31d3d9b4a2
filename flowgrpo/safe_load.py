"""Reading flowgrpo's own torch files (checkpoints, the evaluation grid, the pretraining's resume state)
without running code from them.

``torch.load(..., weights_only=False)`` unpickles whatever a file names: a ``state.pt`` whose pickle
carries a ``__reduce__`` runs it under ``flowgrpo eval``, ``sample``, ``export`` or ``train --resume``.
Everything flowgrpo writes is tensors and plain data (dicts, lists, numbers, strings; the optimizer's
and the schedulers' state dicts, torch's RNG states as byte tensors and numpy's as a dict of ints),
which torch's restricted unpickler (``weights_only=True``) reads as is, so no allow-list is needed.
A file it refuses is therefore not one flowgrpo wrote, and is refused in one line.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from .errors import UserError


class UnsafeFileError(UserError):
    """A torch file holding objects other than tensors and plain data: loading it could run code, so
    it is refused (never passed over for an older checkpoint: someone put it there)."""


def load_tensors(file: Path, what: str = "checkpoint"):
    """``torch.load(file)`` on the CPU, restricted to tensors and plain data (``weights_only=True``).

    ``what`` names the file in the error. An :class:`UnsafeFileError` names the file (and the first
    global it asked for) when the restricted unpickler refuses it; any other failure (a damaged file)
    propagates as torch raised it."""
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):  # a damaged pickle, not a refused one
            raise
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        asked = f" (it asks for {found.group(1)})" if found else ""
        raise UnsafeFileError(f"{file} is not a flowgrpo {what}: it holds objects other than tensors and plain "
                              f"data{asked}, and loading it could run code; refused") from None
