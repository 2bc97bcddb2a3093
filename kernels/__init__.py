from lightinfer.kernels._common import SplitKPartials

__all__ = ["SplitKPartials"]
