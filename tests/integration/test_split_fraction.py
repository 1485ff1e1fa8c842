"""Real models run split: outputs and gradients exact against eager, and the share of forward
FLOPs that runs per device (``explain(...).split_flop_fraction``) at least 95%."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dpcompile
from tests.thirdparty import import_torchvision, models

GOAL = 0.95
# timm's VisionTransformer is not captured by fx (a branch on an optional argument): the
# export frontend's job; everything else must run split
MODELS = [name for name in models() if name not in ("timm_vit_tiny", "tv_resnet18", "tv_convnext_tiny")]  # the last two: in the benchmark (slow)


@pytest.mark.parametrize("name", MODELS)
def test_split_fraction_real_model_runs_split_and_exact(name):
    """The model transforms without the 'runs whole' warning, splits >= 95% of its FLOPs, and
    matches eager outputs and gradients."""
    model, inputs = models()[name]()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=inputs)
    report = dpcompile.explain(pm, *inputs)
    assert report.split_flop_fraction is not None and report.split_flop_fraction >= GOAL, report.whole[:3]
    expected = model(*inputs)
    expected.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = pm(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got.float().pow(2).mean().backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5, msg=f"grad of {n}")


def test_split_fraction_reports_the_op_without_a_rule():
    """An fx-wrapped function without a rule runs whole; explain names it with the reason."""
    model = _Wrapped()
    x = torch.randn(6, 8)
    with pytest.warns(UserWarning, match="register_batch_rule"):
        pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,))
    report = dpcompile.explain(pm, x)
    assert report.split_flop_fraction < 0.9
    assert report.whole[0]["reason"] == f"no batch rule for {__name__}.third_party_scale"
    assert "Split across devices" in str(report) and report.to_dict()["whole"] == report.whole
    torch.testing.assert_close(pm(x), model(x))


def third_party_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


torch.fx.wrap("third_party_scale")


class _Wrapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 64)
        self.fc2 = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc2(third_party_scale(self.fc1(x)))


def _video_swin() -> torch.nn.Module:
    tvm = import_torchvision().models
    return tvm.video.SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                       window_size=[2, 4, 4], stochastic_depth_prob=0.1, num_classes=10)  # fmt: skip


def _video_mvit() -> torch.nn.Module:
    mvit = import_torchvision().models.video.mvit
    block = mvit.MSBlockConfig
    blocks = [block(num_heads=1, input_channels=16, output_channels=16, kernel_q=[3, 3, 3], kernel_kv=[3, 3, 3],
                    stride_q=[1, 1, 1], stride_kv=[1, 2, 2]),
              block(num_heads=2, input_channels=16, output_channels=32, kernel_q=[3, 3, 3], kernel_kv=[3, 3, 3],
                    stride_q=[1, 2, 2], stride_kv=[1, 1, 1])]  # fmt: skip
    return mvit.MViT(spatial_size=(16, 16), temporal_size=4, block_setting=blocks, residual_pool=True,
                     residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True,
                     stochastic_depth_prob=0.1, num_classes=10)  # fmt: skip


@pytest.mark.parametrize("make", [_video_swin, _video_mvit], ids=["swin3d", "mvit_v2"])
def test_torchvision_video_transformers_run_split(make):
    """torchvision's video Swin and MViT-v2: their fx-wrapped helpers (``shifted_window_attention_3d``,
    which writes into its list argument; MViT's ``_unsqueeze``/``_add_rel_pos``/``_add_shortcut``) run
    per device, and explain counts their FLOPs (it ran whole, or no figure at all, before)."""
    torch.manual_seed(0)
    model = make().double()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 3, 4, 16, 16, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,), frontend="fx")
    report = dpcompile.explain(pm, x)
    assert report.split_flop_fraction == 1.0 and report.whole == []
    torch.manual_seed(1)
    got = pm(x)
    torch.manual_seed(1)
    expected = eager(x)
    torch.testing.assert_close(got, expected)
    weights = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).view(expected.shape)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")


class _SegmentationHead(torch.nn.Module):
    """torchvision's DeepLabV3 / FCN / LRASPP: the output resized to ``x.shape[-2:]``."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.classifier = torch.nn.Conv2d(8, 3, 1)

    def forward(self, x):
        input_shape = x.shape[-2:]
        features = self.backbone(x)
        pooled = torch.nn.functional.interpolate(self.pool(features), size=features.shape[-2:], mode="bilinear")
        out = self.classifier(features + pooled)
        return torch.nn.functional.interpolate(out, size=input_shape, mode="bilinear", align_corners=False)


def test_a_size_read_from_the_end_of_a_convolution_input_runs_split_without_examples():
    """Without examples, ``x.shape[-2:]`` of a Conv2d's (or a pooling's) input cannot name the
    batch size (that input has 3 dims or more): the resize to it runs split (it ran whole)."""
    model, x = _SegmentationHead(), torch.randn(4, 3, 16, 16)
    pm = dpcompile.transform(model, ["cpu", "cpu"])
    report = dpcompile.explain(pm, x)
    assert report.whole == [] and report.split_flop_fraction == 1.0
    torch.testing.assert_close(pm(x), model(x))


class _Resizes(torch.nn.Module):
    """Every interpolation mode the export frontend writes as its own ATen op (timm CrossViT's bicubic
    rescale of the image for its second branch; trilinear and nearest on video)."""

    def __init__(self):
        super().__init__()
        self.conv2, self.conv3, self.conv1 = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv3d(3, 4, 1), torch.nn.Conv1d(3, 4, 1)

    def forward(self, image, video, signal):
        f = torch.nn.functional.interpolate
        a = self.conv2(f(image, size=(12, 12), mode="bicubic", align_corners=False))
        b = self.conv3(f(video, scale_factor=2, mode="trilinear")) + f(video, scale_factor=2, mode="nearest").mean(1, keepdim=True)
        c = self.conv1(f(signal, size=10, mode="linear"))
        return a.mean((1, 2, 3)) + b.mean((1, 2, 3, 4)) + c.mean((1, 2))


def test_every_interpolation_mode_runs_split_under_export():
    """``upsample_bicubic2d``, ``upsample_trilinear3d``, ``upsample_nearest3d`` and ``upsample_linear1d``
    are per sample, as bilinear is (CrossViT under export ran 67% of its FLOPs whole)."""
    model = _Resizes()
    inputs = (torch.randn(4, 3, 8, 8), torch.randn(4, 3, 2, 4, 4), torch.randn(4, 3, 5))
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=inputs, frontend="export")
    report = dpcompile.explain(pm, *inputs)
    assert report.whole == [] and report.split_flop_fraction == 1.0
    torch.testing.assert_close(pm(*inputs), model(*inputs))


class _HeadsUnflattened(torch.nn.Module):
    """SigLIP's pooling head, reduced: projections unflattened into heads (``aten.unflatten.int``
    under the export frontend), a per-sample attention, the heads flattened again."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).flatten(2)).pow(2).mean()


def test_unflatten_of_a_feature_dim_runs_split_under_export():
    """``aten.unflatten.int`` has unflatten's rule (it ran whole, and 1F1B refused SigLIP: the
    micro-batches met there); every gradient equals eager's."""
    torch.manual_seed(0)
    model, x = _HeadsUnflattened().double(), torch.randn(4, 5, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,), frontend="export")
    report = dpcompile.explain(pm, x)
    assert report.whole == [] and report.split_flop_fraction == 1.0
    pm(x).backward()
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
