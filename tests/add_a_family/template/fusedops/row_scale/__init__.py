"""Row scale: y = x · w per row (a family that exists to try the layout, tests/add_a_family)."""

from .plans import RowScaleBackward, RowScaleForward, row_scale_backward, row_scale_forward

__all__ = ["RowScaleBackward", "RowScaleForward", "row_scale_backward", "row_scale_forward"]
