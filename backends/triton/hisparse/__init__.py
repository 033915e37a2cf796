"""HiSparse in Triton (docs/hisparse.md): the swap-in of a plan's copies (:mod:`.swap`)."""
