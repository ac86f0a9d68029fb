"""fp4_inductor: a torch.compile backend that runs attention in FP8/FP4 where it wins.

    torch.compile(model, backend="fp4attn")

The public API is what ``__all__`` lists: the backend (``"fp4attn"``, ``backend()``),
``configure()``, ``explain()`` and the records it returns (``Report``, ``SiteRecord``),
``tune()`` and its ``TuneResult``, ``calibrate()`` (this GPU's cost table) and its
``Calibration``, and the eager ``scaled_dot_product_attention`` and
``patch()``; the integrations are ``attn_implementation="fp4attn"`` in transformers and
``integrations.diffusers.use_fp4attn``.  The modules behind them are internal.
"""

import importlib.util
import warnings

from ._version import __version__  # noqa: F401 (the package attribute, not in __all__)
from .calibration import Calibration, calibrate
from .compiler import SiteRecord, backend
from .config import configure
from .eager import patch, scaled_dot_product_attention
from .explain import Report, explain
from .tuning import TuneResult, tune

if importlib.util.find_spec("transformers") is not None:  # attn_implementation="fp4attn"
    try:
        from .integrations import transformers as _transformers  # noqa: F401
    except ImportError as err:  # a transformers without the attention and mask interfaces
        warnings.warn(f"fp4_inductor: attn_implementation='fp4attn' is not registered: {err}", stacklevel=2)

__all__ = ["backend", "configure", "explain", "Report", "SiteRecord", "tune", "TuneResult", "calibrate",
           "Calibration", "scaled_dot_product_attention", "patch"]
