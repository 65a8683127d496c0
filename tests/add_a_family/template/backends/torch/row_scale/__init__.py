"""The row scale in the torch backend: ``program`` serves its plans."""
