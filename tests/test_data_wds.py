"""The WebDataset loader (convit_scale/data/wds.py): shards read from URL locations (a pipe) as from folders."""

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def test_wds_url_locations_stream_through_pipe(fm_wds):
    d = DataConfig(format="wds", train_path=f"pipe:cat {fm_wds}/{{name}}", val_path=str(fm_wds), num_workers=0)
    loader = build_loader(d, LoaderSpec("train", 32, 16))
    x, y = next(iter(loader.epoch(0)))
    assert x.shape == (16, 3, 32, 32)
