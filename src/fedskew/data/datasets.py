"""The built-in datasets: the ``Dataset`` every loader returns, the table that
``fedskew list`` shows (``DATASETS``, with each dataset's default model and its
normalisation constants), the class names in label order, and the normalisation itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Dataset:
    """A loaded dataset, ready for training: tensors normalised, images NCHW."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str]
    source: str
    natural_partition: list[np.ndarray] | None = None


@dataclass(frozen=True)
class DatasetInfo:
    """What `fedskew list` shows about a dataset, and its normalisation constants."""

    name: str
    description: str
    default_model: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "digits",
            "scikit-learn digits: 1,797 8x8 grey images, 10 classes (bundled, no download)",
            "mlp",
            (0.3053,),
            (0.3760,),
        ),
        DatasetInfo(
            "mnist",
            "MNIST handwritten digits: 60,000 + 10,000 28x28 grey images, 10 classes",
            "simple-cnn",
            (0.1307,),
            (0.3081,),
        ),
        DatasetInfo(
            "fmnist",
            "Fashion-MNIST: 60,000 + 10,000 28x28 grey clothing images, 10 classes",
            "simple-cnn",
            (0.2860,),
            (0.3530,),
        ),
        DatasetInfo(
            "cifar10",
            "CIFAR-10: 50,000 + 10,000 32x32 colour images, 10 classes",
            "simple-cnn",
            (0.4914, 0.4822, 0.4465),
            (0.2470, 0.2435, 0.2616),
        ),
        DatasetInfo(
            "cifar100",
            "CIFAR-100: 50,000 + 10,000 32x32 colour images, 100 fine classes",
            "cnn-cifar",
            (0.5071, 0.4865, 0.4409),
            (0.2673, 0.2564, 0.2762),
        ),
        DatasetInfo(
            "tinyimagenet",
            "Tiny ImageNet: 100,000 + 10,000 (val) 64x64 colour images, 200 classes",
            "resnet18",
            (0.4802, 0.4481, 0.3975),
            (0.2770, 0.2691, 0.2821),
        ),
        DatasetInfo(
            "synthetic",
            "FedProx Synthetic(alpha, beta): 60 features, 10 classes, one natural "
            "partition per generated client",
            "mlp",
            (),
            (),
        ),
    )
}

DIGIT_CLASSES = [str(i) for i in range(10)]
FMNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
# CIFAR-100 fine labels in label order (the order of fine_label_names in the meta files).
CIFAR100_CLASSES = """
apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch
crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper
snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television
tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm
""".split()


def _normalised(
    x: np.ndarray, scale: float, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """(x / scale - mean) / std per channel, as a fresh contiguous float32 tensor."""
    # np.array copies (the caller's array is never modified) into C order.
    out = torch.from_numpy(np.array(x, dtype=np.float32, order="C"))
    shape = (1, -1) + (1,) * (out.dim() - 2)
    # In place: for Tiny ImageNet the float copy alone is several GB.
    out.div_(scale)
    out.sub_(torch.tensor(mean, dtype=torch.float32).view(shape))
    out.div_(torch.tensor(std, dtype=torch.float32).view(shape))
    return out
