"""The mamba2_inference family in the torch backend: ``program`` serves its plans."""
