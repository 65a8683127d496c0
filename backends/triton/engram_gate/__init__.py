"""The engram_gate family in the triton backend: ``program`` serves its plans."""
