"""fp4_inductor: a torch.compile backend that runs attention in FP8/FP4 where it wins.

    torch.compile(model, backend="fp4attn")
"""

__version__ = "0.1.0"  # before the imports: tuning keys its cache on it

import importlib.util  # noqa: E402
import warnings  # noqa: E402

from .compiler import backend  # noqa: E402
from .config import configure  # noqa: E402
from .eager import patch, scaled_dot_product_attention  # noqa: E402
from .explain import Report, explain  # noqa: E402
from .tuning import tune  # noqa: E402

if importlib.util.find_spec("transformers") is not None:  # attn_implementation="fp4attn"
    try:
        from .integrations import transformers as _transformers  # noqa: E402,F401
    except ImportError as err:  # a transformers without the attention and mask interfaces
        warnings.warn(f"fp4_inductor: attn_implementation='fp4attn' is not registered: {err}", stacklevel=2)

__all__ = ["backend", "configure", "explain", "tune", "Report", "scaled_dot_product_attention", "patch"]
