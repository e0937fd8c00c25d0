"""The analysis a run logs at every evaluation (convit_scale/analysis/during_training.py): gating per GPSA layer and
head and nonlocality per layer over the first ``log.analysis_images`` real validation images, in a real one-rank
group, equal to the same measures taken on those images directly."""

from __future__ import annotations

import torch
from support import one_rank_group

from convit_scale.analysis.attention import attention_maps, gating, nonlocality_of
from convit_scale.analysis.during_training import epoch_analysis
from convit_scale.config import load_config
from convit_scale.models import create_model


class _Batches:
    """Validation batches of 4 random 16-pixel images: 7 real ones, padded to 8 as the loaders pad the last batch."""

    num_real = 7

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(8, 3, 16, 16, generator=g)

    def epoch(self, epoch: int):
        yield from ((self.images[i:i + 4], torch.zeros(4, dtype=torch.long)) for i in range(0, 8, 4))


def test_gating_and_nonlocality_of_the_first_images_as_measured_directly():
    cfg = load_config(None, ["model.name=convit_nano", "model.num_classes=10", "log.analysis_images=5"])
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=10, drop_path_rate=0.0).eval()
    loader = _Batches()
    with one_rank_group(torch.device("cpu")) as ctx:
        got = epoch_analysis(model.state_dict(), cfg, loader, ctx)
        capped = epoch_analysis(model.state_dict(), load_config(None, ["model.name=convit_nano", "model.num_classes=10",
                                                                        "log.analysis_images=100"]), loader, ctx)
        off = epoch_analysis(model.state_dict(), load_config(None, ["log.analysis_images=0"]), loader, ctx)
    with torch.no_grad():
        maps = attention_maps(model, loader.images[:5])
        want = [nonlocality_of(a, model.grid_size).mean().item() for a in maps]
    assert got["analysis_images"] == 5 and got["gating"] == gating(model)
    assert torch.allclose(torch.tensor(got["nonlocality"]), torch.tensor(want), rtol=1e-5)
    assert capped["analysis_images"] == 7  # the padding is never measured
    assert off is None
