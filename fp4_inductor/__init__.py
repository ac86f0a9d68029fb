"""fp4_inductor: a torch.compile backend that runs attention in FP8/FP4 where it wins.

    torch.compile(model, backend="fp4attn")
"""

from .compiler import backend
from .config import configure
from .explain import Report, explain

__all__ = ["backend", "configure", "explain", "Report"]
__version__ = "0.1.0"
