"""Shapes, the body/head contract, parameter counts and errors of the model registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedskew.core.errors import UsageError
from fedskew.models import MODELS, BodyHeadModel, build_model, split_names

NUM_CLASSES = 10
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# (name, input_shape, options, feature_dim): every input each model claims to support.
CASES = [
    ("mlp", (64,), {}, 200),
    ("mlp", (1, 8, 8), {}, 200),
    ("simple-cnn", (1, 28, 28), {}, 84),
    ("simple-cnn", (3, 32, 32), {}, 84),
    ("simple-cnn", (3, 32, 32), {"norm": "bn"}, 84),
    ("simple-cnn", (1, 28, 28), {"norm": "gn"}, 84),
    ("resnet18", (3, 32, 32), {"width": 16}, 128),
    ("resnet18", (3, 32, 32), {"width": 8, "norm": "gn"}, 64),
    ("cnn-cifar", (3, 32, 32), {}, 192),
    ("fedavg-cnn", (1, 28, 28), {}, 512),
    ("fedavg-cnn", (3, 32, 32), {}, 512),
] + [
    ("resnet18", shape, {"stem": stem, "norm": norm}, 512)
    for shape in ((3, 32, 32), (3, 64, 64))
    for stem in ("cifar", "imagenet")
    for norm in ("bn", "gn")
]


def _case_id(case: tuple) -> str:
    name, shape, options, _ = case
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{name}-{'x'.join(map(str, shape))}" + (f"-{opts}" if opts else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_shapes_and_body_head_contract(case: tuple) -> None:
    name, shape, options, feature_dim = case
    torch.manual_seed(0)
    model = build_model(name, shape, NUM_CLASSES, **options)
    assert isinstance(model, BodyHeadModel)
    assert model.feature_dim == feature_dim
    model.eval()  # BatchNorm must use fixed statistics for the two passes to agree
    x = torch.randn(2, *shape)
    with torch.no_grad():
        features = model.body(x)
        logits = model(x)
        assert features.shape == (2, feature_dim)
        assert logits.shape == (2, NUM_CLASSES)
        assert torch.equal(logits, model.head(model.body(x)))
        assert torch.equal(model.features(x), features)
    body, head = split_names(model)
    keys = list(model.state_dict())
    assert all(k.startswith(("body.", "head.")) for k in keys)
    assert body + head == keys
    assert body and head


def test_mlp_hidden_option() -> None:
    model = build_model("mlp", (64,), 3, hidden="32")
    assert model.feature_dim == 32
    assert model.head.in_features == 32
    assert model.body.fc1.in_features == 64


@pytest.mark.parametrize(("shape", "flat"), [((1, 28, 28), 256), ((3, 32, 32), 400)])
def test_simple_cnn_flatten_size(shape: tuple[int, ...], flat: int) -> None:
    model = build_model("simple-cnn", shape, NUM_CLASSES)
    assert model.body.fc1.in_features == flat
    assert model.body.conv1.in_channels == shape[0]


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_simple_cnn_parameter_count() -> None:
    model = build_model("simple-cnn", (3, 32, 32), 10)
    expected = (
        (3 * 6 * 25 + 6)  # conv1
        + (6 * 16 * 25 + 16)  # conv2
        + (400 * 120 + 120)  # fc1
        + (120 * 84 + 84)  # fc2
        + (84 * 10 + 10)  # head
    )
    assert _count(model) == expected == 62006


def test_cnn_cifar_structure_and_parameter_count() -> None:
    model = build_model("cnn-cifar", (3, 32, 32), 10)
    assert model.body.fc1.in_features == 1600
    assert model.head.bias is None
    expected = (
        (3 * 64 * 25 + 64)  # conv1
        + (64 * 64 * 25 + 64)  # conv2
        + (1600 * 384 + 384)  # fc1
        + (384 * 192 + 192)  # fc2
        + 192 * 10  # bias-free head
    )
    assert _count(model) == expected
    assert not any(isinstance(m, BATCH_NORMS) for m in model.modules())


def test_fedavg_cnn_structure_and_parameter_count() -> None:
    model = build_model("fedavg-cnn", (1, 28, 28), 10)
    # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4: 64 channels of 4x4 are flattened.
    assert model.body.fc1.in_features == 64 * 4 * 4
    assert [m.out_channels for m in model.body if isinstance(m, nn.Conv2d)] == [32, 64]
    assert [m.kernel_size for m in model.body if isinstance(m, nn.Conv2d)] == [(5, 5), (5, 5)]
    assert all(m.padding == (0, 0) for m in model.body if isinstance(m, nn.Conv2d))
    assert [m.out_features for m in model.body if isinstance(m, nn.Linear)] == [512]
    assert model.head.in_features == 512 and model.head.bias is not None
    expected = (
        (1 * 32 * 25 + 32)  # conv1
        + (32 * 64 * 25 + 64)  # conv2
        + (1024 * 512 + 512)  # fc1
        + (512 * 10 + 10)  # head
    )
    assert _count(model) == expected == 582_026  # the count McMahan et al.'s CNN is known by
    assert not any(isinstance(m, BATCH_NORMS) for m in model.modules())
    # CIFAR-sized colour input: 32 -> 28 -> 14 -> 10 -> 5, so 64 * 25 features into fc1.
    assert build_model("fedavg-cnn", (3, 32, 32), 10).body.fc1.in_features == 1600


def test_resnet18_groupnorm_has_no_batchnorm() -> None:
    model = build_model("resnet18", (3, 32, 32), 10, norm="gn")
    assert not any(isinstance(m, BATCH_NORMS) for m in model.modules())
    group_norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert group_norms and all(m.num_groups == 2 for m in group_norms)
    # GroupNorm keeps no buffers, so the state dict holds parameters only.
    assert len(model.state_dict()) == len(list(model.parameters()))


def test_resnet18_batchnorm_buffers_are_split_into_body() -> None:
    model = build_model("resnet18", (3, 32, 32), 10)
    body, head = split_names(model)
    assert "body.stem.norm.running_mean" in body
    assert "body.stem.norm.num_batches_tracked" in body
    assert head == ["head.weight", "head.bias"]


def test_resnet18_parameter_count_and_options() -> None:
    # 11,173,962 is the well-known ResNet-18 count with a CIFAR stem and 10 classes.
    model = build_model("resnet18", (3, 32, 32), 10)
    assert _count(model) == 11_173_962
    no_bias = build_model("resnet18", (3, 32, 32), 10, head_bias=False)
    assert no_bias.head.bias is None
    assert _count(no_bias) == 11_173_962 - 10
    imagenet = build_model("resnet18", (3, 64, 64), 10, stem="imagenet")
    assert imagenet.body.stem.conv.kernel_size == (7, 7)
    assert isinstance(imagenet.body.stem.pool, nn.MaxPool2d)


def test_simple_cnn_norm_puts_a_normalisation_before_every_relu() -> None:
    plain = build_model("simple-cnn", (3, 32, 32), 10)
    assert list(plain.body._modules) == [
        "conv1", "pool1", "relu1", "conv2", "pool2", "relu2", "flatten", "fc1", "relu3", "fc2",
        "relu4",
    ]  # fmt: skip
    for norm, kinds in (("bn", (nn.BatchNorm2d, nn.BatchNorm1d)), ("gn", (nn.GroupNorm,))):
        model = build_model("simple-cnn", (3, 32, 32), 10, norm=norm)
        layers = list(model.body._modules.items())
        relus = [i for i, (_, m) in enumerate(layers) if isinstance(m, nn.ReLU)]
        assert len(relus) == 4
        # the convolution blocks pool between their normalisation and their ReLU
        normed = [i - 2 if isinstance(layers[i - 1][1], nn.MaxPool2d) else i - 1 for i in relus]
        assert all(isinstance(layers[i][1], kinds) for i in normed)
        # one affine pair per normalised layer: 2 x (6 + 16 + 120 + 84) more parameters
        assert _count(model) == _count(plain) + 2 * (6 + 16 + 120 + 84)
    with pytest.raises(UsageError, match="norm"):
        build_model("simple-cnn", (3, 32, 32), 10, norm="ln")


def test_resnet18_width_scales_every_stage() -> None:
    assert _count(build_model("resnet18", (3, 32, 32), 10, width=64)) == 11_173_962
    small = build_model("resnet18", (3, 32, 32), 10, width=16)
    assert small.body.stem.conv.out_channels == 16
    assert [small.body._modules[f"layer{i}"][0].conv1.out_channels for i in (1, 2, 3, 4)] == [
        16, 32, 64, 128,
    ]  # fmt: skip
    with pytest.raises(UsageError, match="width must be even"):
        build_model("resnet18", (3, 32, 32), 10, width=9, norm="gn")
    with pytest.raises(UsageError, match="width"):
        build_model("resnet18", (3, 32, 32), 10, width=0)


def test_resnet18_small_inputs_via_adaptive_pooling() -> None:
    model = build_model("resnet18", (1, 8, 8), 10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_global_pooling_is_adaptive_pooling_bit_for_bit() -> None:
    """The mean over height and width gives nn.AdaptiveAvgPool2d(1)'s bits on the CPU, values
    and gradients, in both memory formats (tests/test_together.py: and it batches under
    vmap, where the layer did not)."""
    from fedskew.models.resnet import GlobalAvgPool

    gen = torch.Generator().manual_seed(0)
    for shape in ((16, 64, 4, 4), (8, 512, 1, 1), (4, 32, 8, 8)):
        for channels_last in (False, True):
            x = torch.randn(*shape, generator=gen)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            ours, theirs = GlobalAvgPool()(a), torch.nn.AdaptiveAvgPool2d(1)(b)
            assert torch.equal(ours, theirs)
            g = torch.randn(ours.shape, generator=gen)
            ours.backward(g), theirs.backward(g)
            assert torch.equal(a.grad, b.grad)


def test_construction_is_deterministic_under_manual_seed() -> None:
    torch.manual_seed(123)
    a = build_model("simple-cnn", (1, 28, 28), 10)
    torch.manual_seed(123)
    b = build_model("simple-cnn", (1, 28, 28), 10)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_registry_descriptions_are_single_lines() -> None:
    assert set(MODELS) == {"mlp", "simple-cnn", "cnn-cifar", "fedavg-cnn", "resnet18"}
    for name, info in MODELS.items():
        assert info.name == name
        assert info.description and "\n" not in info.description
    assert "stem=" in MODELS["resnet18"].description


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(
        UsageError, match="choices: cnn-cifar, fedavg-cnn, mlp, resnet18, simple-cnn"
    ):
        build_model("vgg", (3, 32, 32), 10)


def test_unknown_option() -> None:
    with pytest.raises(UsageError, match="no option depth"):
        build_model("resnet18", (3, 32, 32), 10, depth=34)
    with pytest.raises(UsageError, match="no option hidden"):
        build_model("simple-cnn", (3, 32, 32), 10, hidden=5)
    with pytest.raises(UsageError, match="takes no options"):
        build_model("cnn-cifar", (3, 32, 32), 10, hidden=5)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [({"stem": "tiny"}, "stem"), ({"norm": "ln"}, "norm"), ({"head_bias": "maybe"}, "head_bias")],
)
def test_invalid_option_values(options: dict, pattern: str) -> None:
    with pytest.raises(UsageError, match=pattern):
        build_model("resnet18", (3, 32, 32), 10, **options)


@pytest.mark.parametrize("hidden", [0, -3, "x", True])
def test_invalid_mlp_hidden(hidden: object) -> None:
    with pytest.raises(UsageError, match="hidden"):
        build_model("mlp", (64,), 10, hidden=hidden)


@pytest.mark.parametrize("name", ["simple-cnn", "cnn-cifar", "fedavg-cnn"])
def test_small_images_rejected_by_unpadded_cnns(name: str) -> None:
    with pytest.raises(UsageError, match="at least 16x16") as info:
        build_model(name, (1, 8, 8), 10)
    assert "\n" not in str(info.value)
    build_model(name, (1, 16, 16), 10)  # the smallest size that fits


@pytest.mark.parametrize("name", ["simple-cnn", "cnn-cifar", "fedavg-cnn", "resnet18"])
def test_image_models_reject_tabular_input(name: str) -> None:
    with pytest.raises(UsageError, match=r"needs image input \(C, H, W\)"):
        build_model(name, (64,), 10)


def test_invalid_shape_and_classes() -> None:
    with pytest.raises(UsageError):
        build_model("mlp", (), 10)
    with pytest.raises(UsageError):
        build_model("mlp", (0,), 10)
    with pytest.raises(UsageError):
        build_model("mlp", (4,), 0)


def test_split_names_refuses_stray_keys() -> None:
    model = build_model("mlp", (4,), 2)
    model.register_buffer("stray", torch.zeros(1))
    with pytest.raises(ValueError, match="stray"):
        split_names(model)


@pytest.mark.parametrize("name,shape", [("fedavg-cnn", (1, 28, 28)), ("cnn-cifar", (3, 32, 32))])
def test_pooling_before_relu_gives_the_textbook_values_and_gradients(
    name: str, shape: tuple[int, ...]
) -> None:
    """The CNNs pool before their ReLU for speed; the textbook conv-ReLU-pool stack, built
    here by hand from the same layers, must give the same outputs and gradients bit for bit,
    including inputs whose pooling windows hold ties and exact zeros."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    body = model.body._modules
    convs = [body["conv1"], nn.ReLU(), body["pool1"], body["conv2"], nn.ReLU(), body["pool2"]]
    rest = [
        m
        for k, m in body.items()
        if k not in ("conv1", "pool1", "relu1", "conv2", "pool2", "relu2")
    ]
    reference = nn.Sequential(*convs, *rest)
    x = torch.randn(8, *shape)
    x[:4] = x[:4].round()  # many exact ties and zeros
    outputs = []
    for net in (model.body, reference):
        model.zero_grad(set_to_none=True)
        out = net(x)
        out.pow(2).sum().backward()
        outputs.append((out.detach(), [p.grad.clone() for p in model.body.parameters()]))
    (a, ga), (b, gb) = outputs
    assert torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))
