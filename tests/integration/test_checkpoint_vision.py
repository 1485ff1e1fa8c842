"""Every torchvision and timm model the suite builds that has BatchNorm (tests/thirdparty.py and
benchmarks/dp_models_sweep.py) round-trips: ``save_checkpoint`` → the model built on meta →
``transform`` → ``load_checkpoint``, outputs equal eager. BatchNorm's ``num_batches_tracked`` is a
0-dim tensor, which no such model could load before."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpcompile
from tests.thirdparty import import_timm, import_torchvision


def _tv(name: str, **kw):
    return lambda: getattr(import_torchvision().models, name)(weights=None, **kw)


def _timm(name: str, **kw):
    return lambda: import_timm().create_model(name, pretrained=False, **kw)


# tests/thirdparty.py's models() with BatchNorm, then dp_models_sweep.vision_models()'s (num_classes=5)
BUILDERS = {
    "tv_resnet18": _tv("resnet18"),
    "tv_efficientnet_b0": _tv("efficientnet_b0"),
    "timm_efficientnet_b0": _timm("efficientnet_b0"),
    "tv_resnet34": _tv("resnet34", num_classes=5),
    "tv_mobilenet_v2": _tv("mobilenet_v2", num_classes=5),
    "tv_mobilenet_v3_small": _tv("mobilenet_v3_small", num_classes=5),
    "tv_shufflenet_v2": _tv("shufflenet_v2_x0_5", num_classes=5),
    "tv_densenet121": _tv("densenet121", num_classes=5),
    "tv_mnasnet": _tv("mnasnet0_5", num_classes=5),
    "tv_regnet": _tv("regnet_y_400mf", num_classes=5),
    "timm_resnet10t": _timm("resnet10t", num_classes=5),
    "timm_mobilenetv3": _timm("mobilenetv3_small_050", num_classes=5),
    "timm_regnetx": _timm("regnetx_002", num_classes=5),
    "timm_lcnet": _timm("lcnet_050", num_classes=5),
    "timm_ghostnet": _timm("ghostnet_050", num_classes=5),
}
# two run in every suite; the others (5-40 s each on the shared 2 cores) are marked slow (CI runs them)
FAST = {"timm_resnet10t", "tv_shufflenet_v2"}


def _on_meta(build) -> nn.Module:
    """The model built under ``torch.device("meta")``; regnet's constructor computes its widths with
    tensors, which meta cannot give back as numbers: built, then moved to meta."""
    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError:
        return build().to("meta")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in BUILDERS]
)
def test_a_batchnorm_model_round_trips_through_a_checkpoint_into_a_meta_program(name, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        eager = BUILDERS[name]().eval()
        norms = [m for m in eager.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert norms, f"{name} has no BatchNorm"
        with torch.no_grad():  # running statistics and counts of a trained model, not the defaults
            for k, m in enumerate(norms):
                m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(k + 3)
        x = torch.randn(2, 3, 32, 32)
        want = eager(x)
        dpcompile.save_checkpoint(dpcompile.transform(eager, ["cpu"] * 2), tmp_path)
        model = _on_meta(BUILDERS[name])
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        pm = dpcompile.transform(model.eval(), ["cpu"] * 2)
        assert pm.needs_weights
        dpcompile.load_checkpoint(pm, tmp_path)
    torch.testing.assert_close(pm(x), want, rtol=1e-4, atol=1e-5)
    counts = {k: b for k, b in pm.named_buffers() if k.endswith("num_batches_tracked")}
    assert sorted(int(b) for b in counts.values()) == list(range(3, 3 + len(norms)))
