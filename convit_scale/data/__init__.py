"""Loaders (FFCV, WebDataset, ImageFolder) with one contract, the epoch plan, and the DeiT transforms."""

from .loaders import DataError, LoaderSpec, build_loader, read_manifest

__all__ = ["DataError", "LoaderSpec", "build_loader", "read_manifest"]
