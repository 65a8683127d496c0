"""The engram_gate family in the cute backend: ``program`` serves its plans."""
