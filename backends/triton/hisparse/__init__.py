"""HiSparse's hot-buffer ops in Triton (docs/hisparse.md): :mod:`.plan`, one step's plan on the device."""
