r"""aten_override: replace the kernel of ``aten::convolution_backward`` at PyTorch's dispatcher.

Every convolution's backward — ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose*d``, ``F.conv*``,
``torch.compile``d code, ``vmap`` per-sample gradients — runs the chosen backend, with no model
changes::

    import aten_override
    with aten_override.enable("python"):
        model(x).sum().backward()

Importing this package registers nothing.
"""

from . import backends
from ._registration import active_backend, is_lingering, is_registered, original_kernel, release, reset_stats, stats
from .backends import AUTO_PRIORITY, Backend, FunctionBackend, Implementation, availability
from .context import enable, install, uninstall
from .ops.convolution_backward.args import ConvolutionBackwardArgs
from .tracing import trace

__all__ = [
    "AUTO_PRIORITY",
    "Backend",
    "ConvolutionBackwardArgs",
    "FunctionBackend",
    "Implementation",
    "active_backend",
    "availability",
    "backends",
    "enable",
    "install",
    "is_lingering",
    "is_registered",
    "original_kernel",
    "release",
    "reset_stats",
    "stats",
    "trace",
    "uninstall",
]

__version__ = "0.1.0"
