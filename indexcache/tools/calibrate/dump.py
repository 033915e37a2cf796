"""Reading a dump: every sparse layer's top-k indices, one file per layer, recorded with every layer a producer.

Dump format (one directory, one file per sparse layer, every layer's indexer run, i.e. all layers F)::

    layer_000.pt  layer_001.pt  ...   or   layer_2.npz  layer_4.npz  ...

- The file name gives the layer id: ``layer_<id>.pt`` or ``layer_<id>.npz``, ``<id>`` in ASCII digits,
  leading zeros optional; other files are ignored. Only layers with an indexer belong in the dump (all layers of a
  DeepSeek-V3.2 / GLM-5 style model, the C4 layers of a DeepSeek-V4 one; no MTP layers).
- ``.pt``: a tensor saved with ``torch.save``. ``.npz``: one array, or several with one named
  ``indices``.
- The array holds raw (logical) top-k token positions, ``[rows, k]``, int32 preferred (any integer
  dtype is read; uint64 values must fit in int64); leading dimensions beyond two are flattened into
  rows. ``-1`` marks an empty slot (rows shorter than k); no other negative value is allowed. Order
  inside a row does not matter and a repeated index counts once.
- Row ``r`` must be the same query token in every layer's file, and every file has the same shape, with
  at least one row and ``k >= 1``.

A file that cannot be read (corrupt, truncated, empty, refused by ``torch.load(weights_only=True)``) or
that breaks these rules raises :class:`~indexcache.tools.calibrate.errors.DumpError` naming the file.
:class:`~indexcache.runtime.state.IndexRecorder` writes this format;
:func:`indexcache.tools.model.calibration.record_dump` records one from a prefill of the small random-weight model.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import numpy as np
import torch

from indexcache.tools.calibrate.errors import DumpError
from indexcache.tools.calibrate.indices import as_rows, check_shapes

_LAYER_FILE = re.compile(r"layer_([0-9]+)\.(pt|npz)")  # ASCII digits, the whole name (fullmatch)


def load_dump(path: str | os.PathLike[str]) -> tuple[list[int], list[np.ndarray]]:
    """Read a dump directory: the layer ids (ascending) and one ``[rows, k]`` integer array per layer.

    See the module docstring for the format. Raises ``FileNotFoundError`` for a missing or empty
    directory, ``NotADirectoryError`` for a path that is not one, and :class:`DumpError` (a ``ValueError``) for a
    duplicate layer id, an unreadable or bad file, or mismatched shapes.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a directory; expected the dump directory of layer_<id> files")
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    files: dict[int, Path] = {}
    for file in sorted(directory.iterdir()):
        match = _LAYER_FILE.fullmatch(file.name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer in files:
            raise DumpError(f"{directory}: layer {layer} appears twice ({files[layer].name}, {file.name})")
        files[layer] = file
    if not files:
        raise FileNotFoundError(f"{directory}: no layer_<id>.pt or layer_<id>.npz files")
    layers = sorted(files)
    arrays = [_read_layer(files[layer]) for layer in layers]
    check_shapes(arrays, [str(files[layer]) for layer in layers], DumpError)
    return layers, arrays


def _read_layer(file: Path) -> np.ndarray:
    """One dump file as ``[rows, k]``; every way it can be unreadable or malformed is a :class:`DumpError`."""
    try:
        size = file.stat().st_size
    except OSError as exc:  # a link to nothing, a file removed since the listing
        raise DumpError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    if size == 0:
        raise DumpError(f"{file}: empty file (0 bytes)")
    if file.suffix == ".pt":
        try:
            value = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise DumpError(
                f"{file}: torch.load(weights_only=True) refused it: corrupt, or it pickles objects other than "
                "tensors; save one tensor with torch.save"
            ) from None
        except Exception as exc:  # torch reports a damaged file with many exception types
            raise DumpError(f"{file}: not a readable torch.save file ({_reason(exc)})") from None
        if not isinstance(value, torch.Tensor):
            raise DumpError(f"{file}: holds a {type(value).__name__}, expected one tensor [rows, k]")
        rows = as_rows(value, str(file), DumpError)
    else:
        try:
            with np.load(file) as npz:
                names = list(npz.files)
                chosen = names[0] if len(names) == 1 else "indices" if "indices" in names else None
                value = None if chosen is None else npz[chosen]
        except Exception as exc:  # numpy and zipfile report a damaged file with many exception types
            raise DumpError(f"{file}: not a readable .npz archive ({_reason(exc)})") from None
        if value is None:
            raise DumpError(f"{file}: holds arrays {names}; expected one array, or one named 'indices'")
        rows = as_rows(value, str(file), DumpError)
    if rows.size == 0:
        raise DumpError(f"{file}: shape {rows.shape}; need at least one row and k >= 1")
    low = int(rows.min())
    if low < -1:
        raise DumpError(f"{file}: holds {low}; -1 marks an empty slot and no other negative value is valid")
    return rows


def _reason(exc: Exception) -> str:
    """The first sentence of ``exc``'s message on one line, for an error that names the file."""
    text = str(exc).strip().split("\n")[0].split(". ")[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
