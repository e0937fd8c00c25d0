"""convit-scale: train and analyse ConViT and DeiT on ImageNet at cluster scale."""

from .ffcv_threads import configure as _configure_native_threads

_configure_native_threads()  # before anything imports ffcv (ffcv_threads.py)

__all__ = ["create_model", "list_models"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: the models (torch, timm) load on first use, not on `import convit_scale`, so that the command line
    # answers --help and refuses bad input without the seconds that importing torch takes.
    if name in __all__:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'convit_scale' has no attribute {name!r}")
