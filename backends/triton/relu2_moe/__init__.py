"""The relu2_moe family in the triton backend: ``program`` serves its plans."""
