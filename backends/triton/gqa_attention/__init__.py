"""The gqa_attention family in the triton backend: ``program`` serves its plans."""
