"""fp4_inductor: a torch.compile backend that runs attention in FP8/FP4 where it wins.

    torch.compile(model, backend="fp4attn")
"""

__version__ = "0.1.0"  # before the imports: tuning keys its cache on it

from .compiler import backend  # noqa: E402
from .config import configure  # noqa: E402
from .explain import Report, explain  # noqa: E402
from .tuning import tune  # noqa: E402

__all__ = ["backend", "configure", "explain", "tune", "Report"]
