"""The gqa_attention family in the torch backend: ``program`` serves its plans."""
