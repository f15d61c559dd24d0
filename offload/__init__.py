"""offload: train PyTorch models beyond accelerator memory.

Parameters, gradients and optimizer state live on three tiers (device, pinned host memory, NVMe
files) and stream between them through asynchronous queues; a native CPU Adam runs the optimizer
step. The public face is small::

    model, optimizer = offload.wrap(model, config)

Everything else lives in subpackages (``offload.optim``, ``offload.io``, ``offload.store``,
``offload.api``, ...) whose ``__init__`` re-exports only what users need.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use, so `import offload` is cheap)
_EXPORTS = {
    "wrap": "offload.api",
    "register_external_parameter": "offload.api",
    "save_checkpoint": "offload.api",
    "load_checkpoint": "offload.api",
    "export": "offload.api",
    "CheckpointError": "offload.api",
    "from_pretrained": "offload.api",
    "save_pretrained": "offload.api",
    "route_clipping": "offload.api.clipping",
    "OffloadTrainer": "offload.api.trainer",  # needs transformers: not in __all__
    "OffloadConfig": "offload.config",
    "load_config": "offload.config",
    "ConfigError": "offload.config",
    "CPUAdam": "offload.optim",
}

__all__ = [
    "__version__",
    "wrap",
    "register_external_parameter",
    "save_checkpoint",
    "load_checkpoint",
    "export",
    "CheckpointError",
    "from_pretrained",
    "save_pretrained",
    "route_clipping",
    "OffloadConfig",
    "load_config",
    "ConfigError",
    "CPUAdam",
]

if TYPE_CHECKING:  # pragma: no cover
    from offload.api import (
        CheckpointError,
        export,
        from_pretrained,
        load_checkpoint,
        register_external_parameter,
        save_checkpoint,
        save_pretrained,
        wrap,
    )
    from offload.api.clipping import route_clipping
    from offload.api.trainer import OffloadTrainer  # noqa: F401 (needs transformers)
    from offload.config import ConfigError, OffloadConfig, load_config
    from offload.optim import CPUAdam


def __getattr__(name: str) -> Any:
    modname = _EXPORTS.get(name)
    if modname is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(modname), name)
    globals()[name] = value
    return value


# ------------------------------------------------------------------ torch's clipping, guarded
# (offload.api.clipping's Note on the guard). It is installed here, at `import offload`, so a
# script's `from torch.nn.utils import clip_grad_norm_` after it binds the guarded function;
# without torch loaded yet it is installed as torch finishes loading (importing torch here
# would cost every `import offload` ~2 s). Until a wrap registers a model whose gradients
# live outside .grad the guard only passes the call on to torch.
# (clip_grads_with_norm_, torch >= 2.6's two-step clipping after get_total_norm over the .grad
# tensors, clipped nothing unsaid until 2026-12-07: get_total_norm takes no parameters to refuse)
_CLIP_GUARDED = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def _guard_torch_clipping() -> None:
    """Puts :func:`_clip_guard` around ``torch.nn.utils``' clipping functions (idempotent)."""
    import torch.nn.utils  # noqa: PLC0415 - loaded already: called once torch is
    import torch.nn.utils.clip_grad  # noqa: PLC0415

    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in _CLIP_GUARDED:
            fn = getattr(module, name, None)  # (None: a torch without it)
            if fn is not None and not getattr(fn, "_offload_guard", False):
                setattr(module, name, _clip_guard(fn, name))


def _clip_guard(torch_fn, name: str):
    """``torch_fn``, refusing parameters offload holds the gradients of
    (``offload.api.clipping.refuse``; before anything imported that, no model was wrapped)."""

    @functools.wraps(torch_fn)
    def clip(parameters, *args, **kwargs):
        clipping = sys.modules.get("offload.api.clipping")
        if clipping is not None:
            parameters = clipping.refuse(parameters, f"torch.nn.utils.{name}")
        return torch_fn(parameters, *args, **kwargs)

    clip._offload_guard = True
    return clip


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` once the package ``name`` has been loaded, and leaves ``sys.meta_path``
    (Python has no post-import hook: PEP 369 was withdrawn). It asks the other finders for the
    package's spec and wraps its loader; a spec found but never loaded
    (``importlib.util.find_spec``, which transformers asks to see whether a package is
    installed) leaves it in place for the import that follows. Used for torch's clipping
    (below) and for Accelerate's (``offload.api.clipping``)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    @classmethod
    def run_once_loaded(cls, name: str, then) -> None:
        """``then()`` now if ``name`` is loaded, else once it is (one finder per name)."""
        if name in sys.modules:
            then()
        elif not any(isinstance(f, cls) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, cls(name, then))

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then()

        spec.loader.exec_module = exec_module
        return spec


AfterImport.run_once_loaded("torch", _guard_torch_clipping)
