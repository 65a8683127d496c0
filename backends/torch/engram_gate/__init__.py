"""The engram_gate family in the torch backend: ``program`` serves its plans."""
