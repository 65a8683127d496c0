"""The row scale in the triton backend: ``program`` serves its plans."""
