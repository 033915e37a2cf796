"""What a run of the small model is checked against before any work: sizes in their ranges, a backend that runs
here, and the memory the run needs against what the device has free. A setting that fails raises
:class:`~indexcache.tools.model.config.ModelSettingError` naming it."""

from __future__ import annotations

import contextlib
import os

import torch

from indexcache.hal import dispatch
from indexcache.plan import MAX_LAYERS, MAX_TOPK
from indexcache.plan.jsontext import shown
from indexcache.tools.model.config import ModelConfig, ModelSettingError

# torch.Generator.manual_seed takes 64 bits (a negative seed s is the seed 2^64 + s, so none is lost).
MAX_SEED = 2**64 - 1
# Token positions, slots and request ids are int32: no size of a run goes past 2^31 - 1 (memory refuses far less).
_INT32 = 2**31 - 1
_LARGEST = {"topk": MAX_TOPK, "freq": MAX_LAYERS, "seed": MAX_SEED, "batch": _INT32, "prompt_len": _INT32,
            "decode_steps": _INT32}


def check_sizes(**sizes: int | None) -> None:
    """Raise :class:`ModelSettingError` unless every given size (None: the default) is an integer >= 1, ``topk`` at
    most :data:`MAX_TOPK`, ``freq`` at most the plan's ``MAX_LAYERS``, ``seed`` in ``0..MAX_SEED`` and the others at
    most 2^31 - 1."""
    for key, value in sizes.items():
        if value is None:
            continue
        low, high = 0 if key == "seed" else 1, _LARGEST.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ModelSettingError(f"{key}={shown(value)}: must be an integer >= {low}")
        if high is not None and value > high:
            raise ModelSettingError(f"{key}={shown(value)}: must be at most {high}")


def run_bytes(config: ModelConfig, *, batch: int, prompt_len: int, decode_steps: int = 0,
              record: bool = False) -> dict[str, int]:
    """A lower bound, in bytes, of the memory a run of ``config`` holds at once, by what holds it: ``batch`` prompts
    of ``prompt_len`` tokens prefilled together, ``decode_steps`` decode steps, with ``record`` every sparse layer's
    prefill top-k kept.

    Only what is certainly alive together when the last producer layer of the prefill scores (R = batch x
    prompt_len rows, as many keys): its logits ``[R, R]`` float32, the hidden states ``x`` and ``h`` of R rows, the
    paged caches of every layer, the top-k state, the decode logits and, with ``record``, the other sparse layers'
    recorded ``[R, k]`` int32. A run needs more (a forward's other activations, the ops' chunks): measured on a CPU
    (v32-like, k 128, record), a peak of 76 MB against this bound's 8 MB at 512 rows and 601 MB against 116 MB at
    4096; the logits grow fastest, so the bound closes in on large runs. A run refused on it could never fit.
    """
    c = config
    rows = batch * prompt_len
    sparse = len(c.sparse_layers)
    tokens = batch * -(-(prompt_len + decode_steps) // c.page_size) * c.page_size
    return {
        "prefill logits [batch x prompt_len]^2 float32": 4 * rows * rows,
        "hidden states": 2 * 4 * rows * c.hidden,
        "paged KV and index-K caches": tokens * (c.num_layers * 4 * c.head_dim + sparse * (c.index_dim + 4)),
        "top-k state": 2 * 4 * rows * c.topk,
        "decode logits [decode_steps, batch, vocab] float32": 4 * decode_steps * batch * c.vocab,
        "recorded top-k": 4 * (sparse - 1) * rows * c.topk if record else 0,
    }


def free_bytes(device: str) -> int | None:
    """Memory free for a run on ``device``: the GPU's free memory, or the host's available memory (Linux
    ``MemAvailable``; elsewhere the free physical pages); None where it cannot be told."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def check_fits(config: ModelConfig, device: str, **sizes: int) -> None:
    """Raise :class:`ModelSettingError` when the run of ``sizes`` needs more memory (at least :func:`run_bytes`) than
    ``device`` has free: refused before anything is allocated."""
    terms = run_bytes(config, **sizes)
    need, free = sum(terms.values()), free_bytes(device)
    if free is not None and need > free:
        given = ", ".join(f"{key}={shown(value)}" for key, value in sizes.items() if key != "record")
        most = max(terms, key=terms.__getitem__)
        raise ModelSettingError(
            f"{given}, topk={config.topk}: the run needs at least {need / 2**30:.3g} GiB on {device}, most of it for "
            f"the {most}, more than the {free / 2**30:.3g} GiB free"
        )


def backend_setup(backend: str | None) -> tuple[str, dispatch.Availability, dict[str, str]]:
    """``backend`` (None: the automatic choice), its availability here, and the config overrides it needs (the fp8
    format its kernels compute in). An unknown name raises ``UnknownBackendError``; one that cannot run here
    :class:`ModelSettingError`."""
    chosen = backend or dispatch.get_backend()
    avail = dispatch.availability(chosen)
    if not avail.available:
        raise ModelSettingError(f"backend {chosen!r} is not available here: {avail.reason}")
    fp8 = dispatch.get(chosen).capabilities().fp8_dtype
    return chosen, avail, ({"index_dtype": str(fp8).removeprefix("torch.")} if fp8 is not None else {})
