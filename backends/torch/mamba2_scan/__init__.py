"""The mamba2_scan family in the torch backend: ``program`` serves its plans."""
