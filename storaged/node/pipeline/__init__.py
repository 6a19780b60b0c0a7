"""Background stages of a chunk's life: drain, encode, repair, GC, scrub (one module each)."""
