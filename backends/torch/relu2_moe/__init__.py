"""The relu2_moe family in the torch backend: ``program`` serves its plans."""
