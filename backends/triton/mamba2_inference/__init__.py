"""The mamba2_inference family in the triton backend: ``program`` serves its plans."""
