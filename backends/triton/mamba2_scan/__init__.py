"""The mamba2_scan family in the triton backend: ``program`` serves its plans."""
