"""Dataset loaders, on tiny files written in each dataset's official on-disk format."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import socket
import struct
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.core.errors import DataError, UsageError
from fedskew.data import formats, sources
from fedskew.data.sources import CIFAR10_CLASSES, DATASETS, Dataset, load_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
N_TRAIN, N_TEST = 20, 10


@pytest.fixture(autouse=True)
def hermetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real network, no real cache, no offline copies found through the working dir."""

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    cwd = tmp_path / "cwd" / "work"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)


def expected_pixel(value: int, channel: int, name: str) -> float:
    info = DATASETS[name]
    return (value / 255.0 - info.mean[channel]) / info.std[channel]


def check_common(ds: Dataset, n_train: int, n_test: int, shape: tuple[int, ...]) -> None:
    assert ds.x_train.shape == (n_train, *shape)
    assert ds.x_test.shape == (n_test, *shape)
    assert ds.x_train.dtype == torch.float32 and ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == torch.int64 and ds.y_test.dtype == torch.int64
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert ds.x_train.is_contiguous() and ds.x_test.is_contiguous()
    assert ds.input_shape == shape
    assert len(ds.class_names) == ds.num_classes


# --------------------------------------------------------------------------- idx


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim
    return (
        struct.pack(">I", magic)
        + struct.pack(f">{array.ndim}I", *array.shape)
        + (array.astype(np.uint8).tobytes())
    )


def idx_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (N_TRAIN, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, N_TRAIN, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (N_TEST, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, N_TEST, dtype=np.uint8),
    }


def write_idx(folder: Path, arrays: dict[str, np.ndarray], gz: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for base, array in arrays.items():
        if gz:
            (folder / f"{base}.gz").write_bytes(gzip.compress(idx_bytes(array)))
        else:
            (folder / base).write_bytes(idx_bytes(array))


def test_mnist_idx_gz(tmp_path: Path) -> None:
    arrays = idx_arrays(0)
    write_idx(tmp_path / "data", arrays)
    ds = load_dataset("mnist", tmp_path / "data", download=False)
    check_common(ds, N_TRAIN, N_TEST, (1, 28, 28))
    assert ds.num_classes == 10
    assert ds.y_train.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert ds.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    value = int(arrays["train-images-idx3-ubyte"][3, 5, 7])
    assert ds.x_train[3, 0, 5, 7].item() == pytest.approx(expected_pixel(value, 0, "mnist"), 1e-5)
    assert str(tmp_path / "data") in ds.source


def test_fmnist_uncompressed_in_named_subfolder(tmp_path: Path) -> None:
    arrays = idx_arrays(1)
    write_idx(tmp_path / "data" / "fashion-mnist", arrays, gz=False)
    ds = load_dataset("fmnist", tmp_path / "data", download=False)
    check_common(ds, N_TRAIN, N_TEST, (1, 28, 28))
    assert ds.class_names[0] == "T-shirt/top"
    value = int(arrays["t10k-images-idx3-ubyte"][9, 27, 0])
    assert ds.x_test[9, 0, 27, 0].item() == pytest.approx(expected_pixel(value, 0, "fmnist"), 1e-5)
    assert "Fashion-MNIST" in ds.source


def test_mnist_found_in_torchvision_raw_folder(tmp_path: Path) -> None:
    write_idx(tmp_path / "data" / "MNIST" / "raw", idx_arrays(2))
    ds = load_dataset("mnist", tmp_path / "data", download=False)
    assert ds.x_train.shape[0] == N_TRAIN


def test_idx_bad_magic_names_file(tmp_path: Path) -> None:
    arrays = idx_arrays(3)
    write_idx(tmp_path, arrays)
    bad = tmp_path / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(idx_bytes(arrays["train-images-idx3-ubyte"])))
    with pytest.raises(DataError, match="bad magic number") as err:
        load_dataset("mnist", tmp_path, download=False)
    assert str(bad) in str(err.value)


def test_idx_truncated_data_names_file(tmp_path: Path) -> None:
    arrays = idx_arrays(4)
    write_idx(tmp_path, arrays)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(gzip.compress(idx_bytes(arrays["t10k-images-idx3-ubyte"])[:-100]))
    with pytest.raises(DataError, match="truncated") as err:
        load_dataset("mnist", tmp_path, download=False)
    assert str(bad) in str(err.value)


def test_idx_truncated_gzip_names_file(tmp_path: Path) -> None:
    write_idx(tmp_path, idx_arrays(5))
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:200])
    with pytest.raises(DataError) as err:
        load_dataset("fmnist", tmp_path, download=False)
    assert str(bad) in str(err.value)


def test_idx_not_gzip_names_file(tmp_path: Path) -> None:
    write_idx(tmp_path, idx_arrays(5))
    bad = tmp_path / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(b"this is not gzip data at all")
    with pytest.raises(DataError, match="gzip") as err:
        load_dataset("mnist", tmp_path, download=False)
    assert str(bad) in str(err.value)


def test_idx_incomplete_set(tmp_path: Path) -> None:
    write_idx(tmp_path, idx_arrays(6))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        load_dataset("mnist", tmp_path, download=False)


# --------------------------------------------------------------------------- CIFAR


def cifar_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar10_binary(folder: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Six batches of 4 (train) or N_TEST (test) records; returns all images and labels."""
    folder.mkdir(parents=True)
    images, labels = [], []
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for i, name in enumerate(names):
        n = 4 if i < 5 else N_TEST
        x = cifar_images(n, seed + i)
        y = (np.arange(n) + i) % 10
        (folder / name).write_bytes(np.hstack([y[:, None].astype(np.uint8), x]).tobytes())
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels)


def test_cifar10_binary(tmp_path: Path) -> None:
    images, labels = write_cifar10_binary(tmp_path / "data" / "cifar-10-batches-bin")
    ds = load_dataset("cifar10", tmp_path / "data", download=False)
    check_common(ds, 20, N_TEST, (3, 32, 32))
    assert ds.y_train.tolist() == labels[:20].tolist()
    assert ds.y_test.tolist() == labels[20:].tolist()
    # Records hold the red plane, then green, then blue, each row-major 32x32.
    for channel, (row, col) in enumerate([(0, 0), (31, 2), (17, 30)]):
        value = int(images[7, channel * 1024 + row * 32 + col])
        got = ds.x_train[7, channel, row, col].item()
        assert got == pytest.approx(expected_pixel(value, channel, "cifar10"), 1e-5)
    assert ds.class_names == CIFAR10_CLASSES
    assert "binary" in ds.source


def test_cifar10_binary_wrong_size_names_file(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    bad = folder / "data_batch_3.bin"
    bad.write_bytes(bad.read_bytes()[:-1])
    with pytest.raises(DataError, match="wrong size") as err:
        load_dataset("cifar10", tmp_path, download=False)
    assert str(bad) in str(err.value)


def test_cifar10_binary_missing_batch(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar10_binary(folder)
    (folder / "test_batch.bin").unlink()
    with pytest.raises(DataError, match="missing test_batch.bin"):
        load_dataset("cifar10", tmp_path, download=False)


def test_cifar10_python(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    all_x, all_y = [], []
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        n = 4 if i < 5 else N_TEST
        x = cifar_images(n, 10 + i)
        y = [(j * 3 + i) % 10 for j in range(n)]
        # The official batches: a dict with byte-string keys, labels as a list of ints.
        batch = {
            b"batch_label": f"batch {i}".encode(),
            b"labels": y,
            b"data": x,
            b"filenames": [f"img_{i}_{j}.png".encode() for j in range(n)],
        }
        with open(folder / name, "wb") as fh:
            pickle.dump(batch, fh)
        all_x.append(x)
        all_y += y
    ds = load_dataset("cifar10", tmp_path, download=False)
    check_common(ds, 20, N_TEST, (3, 32, 32))
    assert ds.y_train.tolist() + ds.y_test.tolist() == all_y
    x = np.concatenate(all_x)
    value = int(x[21, 2 * 1024 + 3 * 32 + 4])
    assert ds.x_test[1, 2, 3, 4].item() == pytest.approx(expected_pixel(value, 2, "cifar10"), 1e-5)
    assert "python" in ds.source


def py2_string(data: bytes) -> bytes:
    """A Python 2 ``str`` as cPickle protocol 2 writes it (loads as bytes in Python 3)."""
    if len(data) < 256:
        return b"U" + bytes([len(data)]) + data
    return b"T" + struct.pack("<i", len(data)) + data


def py2_int(value: int) -> bytes:
    if value < 256:
        return b"K" + bytes([value])
    return b"M" + struct.pack("<H", value)


def py2_cifar_batch(data: np.ndarray, labels: list[int], label_key: bytes) -> bytes:
    """Opcode for opcode, a CIFAR batch as the official files have it (Python 2 + numpy 1)."""
    array = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
    array += py2_int(0) + b"\x85" + py2_string(b"b") + b"\x87R("
    array += py2_int(1) + py2_int(data.shape[0]) + py2_int(data.shape[1]) + b"\x86"
    array += b"cnumpy\ndtype\n" + py2_string(b"u1") + b"\x89\x88\x87R("
    array += py2_int(3) + py2_string(b"|") + b"NNN" + b"J\xff\xff\xff\xffJ\xff\xff\xff\xff"
    array += py2_int(0) + b"tb\x89" + py2_string(data.tobytes()) + b"tb"
    label_list = b"](" + b"".join(py2_int(v) for v in labels) + b"e"
    return (
        b"\x80\x02}("
        + py2_string(b"data")
        + array
        + py2_string(label_key)
        + label_list
        + py2_string(b"batch_label")
        + py2_string(b"training batch")
        + b"u."
    )


def test_cifar100_python_in_py2_pickle_format(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "cifar-100-python"
    folder.mkdir(parents=True)
    x_train, x_test = cifar_images(N_TRAIN, 1), cifar_images(N_TEST, 2)
    y_train = [(7 * i) % 100 for i in range(N_TRAIN)]
    y_test = [99 - i for i in range(N_TEST)]
    (folder / "train").write_bytes(py2_cifar_batch(x_train, y_train, b"fine_labels"))
    (folder / "test").write_bytes(py2_cifar_batch(x_test, y_test, b"fine_labels"))
    ds = load_dataset("cifar100", tmp_path / "data", download=False)
    check_common(ds, N_TRAIN, N_TEST, (3, 32, 32))
    assert ds.num_classes == 100
    assert ds.y_train.tolist() == y_train and ds.y_test.tolist() == y_test
    value = int(x_train[5, 1024 + 40])
    assert ds.x_train[5, 1, 1, 8].item() == pytest.approx(
        expected_pixel(value, 1, "cifar100"), 1e-5
    )
    assert ds.class_names[0] == "apple" and ds.class_names[99] == "worm"


def test_cifar100_binary_uses_fine_labels(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    for name, n in (("train.bin", N_TRAIN), ("test.bin", N_TEST)):
        fine = (np.arange(n) * 11) % 100
        coarse = fine // 5
        records = np.hstack([coarse[:, None], fine[:, None], cifar_images(n, n)])
        (folder / name).write_bytes(records.astype(np.uint8).tobytes())
    ds = load_dataset("cifar100", tmp_path, download=False)
    check_common(ds, N_TRAIN, N_TEST, (3, 32, 32))
    assert ds.y_train.tolist() == ((np.arange(N_TRAIN) * 11) % 100).tolist()
    assert ds.num_classes == 100


class RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": RunsCommand(marker), b"labels": [0]}, fh)
    with pytest.raises(DataError, match="not allowed") as err:
        load_dataset("cifar10", tmp_path, download=False)
    assert str(folder / "data_batch_1") in str(err.value)
    assert "system" in str(err.value)
    assert not marker.exists()

    # Directly, too: builtins such as eval are refused, plain numpy arrays are not.
    with pytest.raises(pickle.UnpicklingError):
        formats.RestrictedUnpickler(io.BytesIO(pickle.dumps(eval))).load()
    array = np.arange(12, dtype=np.uint8).reshape(3, 4)
    for protocol in (3, 4, 5):
        loaded = formats.RestrictedUnpickler(io.BytesIO(pickle.dumps(array, protocol))).load()
        assert np.array_equal(loaded, array)


def write_class_folders(
    root: Path, classes: list[str], per_class: dict[str, int], suffix: str = ".png"
) -> None:
    """{train,test}/<class>/NNNN<suffix> images whose pixels all equal 20 * label + split."""
    for split_index, split in enumerate(("train", "test")):
        for label, cls in enumerate(classes):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class[cls] if split == "train" else 1):
                value = 20 * label + split_index
                Image.new("RGB", (32, 32), (value, value, value)).save(folder / f"{i:04d}{suffix}")


def test_cifar10_class_folders_follow_cifar_label_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data" / "cifar10"
    per_class = {cls: 1 + (i % 3) for i, cls in enumerate(CIFAR10_CLASSES)}
    write_class_folders(root, CIFAR10_CLASSES, per_class)
    ds = load_dataset("cifar10", tmp_path / "data", download=False)
    n_train = sum(per_class.values())
    check_common(ds, n_train, 10, (3, 32, 32))
    # Alphabetical order would put "automobile" before "bird" ... and "truck" last anyway;
    # "deer"/"dog" and "horse"/"frog" differ, so check every class explicitly.
    expected = np.repeat(np.arange(10), [per_class[c] for c in CIFAR10_CLASSES])
    assert ds.y_train.tolist() == expected.tolist()
    assert ds.y_test.tolist() == list(range(10))
    for i, label in enumerate(expected):
        value = 20 * int(label)
        assert ds.x_train[i, 0, 0, 0].item() == pytest.approx(expected_pixel(value, 0, "cifar10"))
    assert "image folders" in ds.source

    # The decoded arrays are cached next to the folder; a second load decodes nothing.
    assert (tmp_path / "data" / "cifar10.fedskew.npz").is_file()

    def no_decoding(*args: object) -> None:
        raise AssertionError("decoded again despite the cache")

    monkeypatch.setattr(formats, "decode_images", no_decoding)
    again = load_dataset("cifar10", tmp_path / "data", download=False)
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)


def test_cifar10_folder_with_unknown_class_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cifar10-jpeg"
    write_class_folders(root, CIFAR10_CLASSES, dict.fromkeys(CIFAR10_CLASSES, 1))
    (root / "train" / "unicorn").mkdir()
    with pytest.raises(DataError, match="unicorn"):
        load_dataset("cifar10", tmp_path, download=False)


def make_jpeg_tarball(tmp_path: Path) -> Path:
    staging = tmp_path / "staging"
    write_class_folders(
        staging / "cifar10-jpeg", CIFAR10_CLASSES, dict.fromkeys(CIFAR10_CLASSES, 2), ".jpg"
    )
    shared = tmp_path / "shared"
    shared.mkdir()
    tarball = shared / "cifar10-jpeg.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(staging / "cifar10-jpeg", arcname="cifar10-jpeg")
    return tarball


def test_cifar10_jpeg_tarball_is_extracted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tarball = make_jpeg_tarball(tmp_path)
    digest = hashlib.md5(tarball.read_bytes()).hexdigest()
    (tarball.parent / "MD5SUMS").write_text(f"{digest}  cifar10-jpeg.tar.gz\n")
    data = tmp_path / "data"
    monkeypatch.setenv("FEDSKEW_DATA", str(tarball.parent))
    ds = load_dataset("cifar10", data, download=False)
    check_common(ds, 20, 10, (3, 32, 32))
    assert "JPEG copy" in ds.source
    assert (data / "cifar10" / "cifar10-jpeg" / "train" / "truck").is_dir()
    # JPEG is lossy: pixel values are close to, not equal to, the encoded ones.
    truck = ds.x_train[ds.y_train == 9] * DATASETS["cifar10"].std[0] + DATASETS["cifar10"].mean[0]
    assert truck[:, 0].mean().item() * 255 == pytest.approx(180, abs=3)
    tarball.unlink()
    assert load_dataset("cifar10", data, download=False).source == ds.source


def test_cifar10_jpeg_tarball_checksum_mismatch(tmp_path: Path) -> None:
    tarball = make_jpeg_tarball(tmp_path)
    (tarball.parent / "MD5SUMS").write_text("0" * 32 + "  cifar10-jpeg.tar.gz\n")
    with pytest.raises(DataError, match="checksum mismatch") as err:
        load_dataset("cifar10", tarball.parent, download=False)
    assert str(tarball) in str(err.value)


def test_official_archive_with_wrong_md5_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "cifar-100-python.tar.gz"
    with tarfile.open(fake, "w:gz") as tf:
        tf.add(tmp_path / "cwd", arcname="cifar-100-python")
    with pytest.raises(DataError, match="checksum mismatch") as err:
        load_dataset("cifar100", tmp_path, download=False)
    assert str(fake) in str(err.value)


# --------------------------------------------------------------------------- Tiny ImageNet


def test_tinyimagenet_folder_layout(tmp_path: Path) -> None:
    root = tmp_path / "data" / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # class order is the line order, not sorted
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tsalamander\n")
    for label, wnid in enumerate(wnids):
        folder = root / "train" / wnid / "images"
        folder.mkdir(parents=True)
        for i in range(2):
            name = f"{wnid}_{i}.JPEG"
            if label == 2 and i == 1:  # Tiny ImageNet has some greyscale images
                Image.new("L", (64, 64), 90).save(folder / name, quality=95)
            else:
                Image.new("RGB", (64, 64), (30 * label, 10, 200)).save(folder / name, quality=95)
    annotations = []
    for i, wnid in enumerate(["n03", "n02", "n01", "n02"]):
        Image.new("RGB", (64, 64), (0, 0, 0)).save(root / "val" / "images" / f"val_{i}.JPEG")
        annotations.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")

    ds = load_dataset("tinyimagenet", tmp_path / "data", download=False)
    check_common(ds, 6, 4, (3, 64, 64))
    assert ds.num_classes == 3
    assert ds.class_names == ["salamander", "goldfish", "n03"]
    assert ds.y_train.tolist() == [0, 0, 1, 1, 2, 2]
    assert ds.y_test.tolist() == [2, 0, 1, 0]
    grey = ds.x_train[5] * torch.tensor(DATASETS["tinyimagenet"].std).view(3, 1, 1)
    grey = (grey + torch.tensor(DATASETS["tinyimagenet"].mean).view(3, 1, 1)) * 255
    assert torch.allclose(grey, torch.full_like(grey, 90.0), atol=2)


# --------------------------------------------------------------------------- not found


def test_missing_dataset_without_download(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_dataset("cifar100", tmp_path / "nowhere", download=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cifar100: no data found in")
    assert str(tmp_path / "nowhere") in message and "download disabled" in message
    assert "--data-dir" in message


def test_missing_dataset_download_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend Debian's package is not installed, whatever this machine has.
    system_dir = tmp_path / "usr-share-datasets-fashion-mnist"
    spec = dataclasses.replace(sources._SPECS["fmnist"], system_dirs=(str(system_dir),))
    monkeypatch.setitem(sources._SPECS, "fmnist", spec)
    data = tmp_path / "data"
    with pytest.raises(DataError) as err:
        load_dataset("fmnist", data)
    message = str(err.value)
    assert "\n" not in message and "download failed (no network)" in message
    assert str(system_dir) in message and "dataset-fashion-mnist" in message
    assert not data.exists()  # a failed download leaves no empty folders behind


def fake_server(monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes]) -> None:
    def urlopen(url: str, timeout: float | None = None) -> io.BytesIO:
        assert timeout is not None
        return io.BytesIO(files[url.rsplit("/", 1)[1]])

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


def test_download_verifies_md5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = idx_arrays(7)
    files = {f"{b}.gz": gzip.compress(idx_bytes(a)) for b, a in arrays.items()}
    spec = sources._SPECS["mnist"]
    remotes = tuple(
        dataclasses.replace(r, md5=hashlib.md5(files[r.filename]).hexdigest()) for r in spec.remotes
    )
    monkeypatch.setitem(sources._SPECS, "mnist", dataclasses.replace(spec, remotes=remotes))
    fake_server(monkeypatch, files)
    ds = load_dataset("mnist", tmp_path / "data")
    assert ds.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    assert sorted(p.name for p in (tmp_path / "data" / "mnist").iterdir()) == sorted(files)

    # With the published md5s these files do not match: refused, and nothing is left.
    monkeypatch.setitem(sources._SPECS, "mnist", spec)
    with pytest.raises(DataError, match="checksum mismatch"):
        load_dataset("mnist", tmp_path / "other")
    assert not (tmp_path / "other").exists()


# --------------------------------------------------------------------------- built-in data


def test_unknown_dataset() -> None:
    with pytest.raises(UsageError, match="unknown dataset 'imagenet'; choose from: digits, mnist"):
        load_dataset("imagenet")


def test_digits_fixed_split() -> None:
    first = load_dataset("digits")
    check_common(first, 1437, 360, (1, 8, 8))
    second = load_dataset("digits", seed=123)
    assert torch.equal(first.x_train, second.x_train) and torch.equal(first.y_test, second.y_test)
    assert torch.bincount(first.y_test).min() >= 35  # stratified: ~36 per class
    assert abs(first.x_train.mean().item()) < 0.05 and abs(first.x_train.std().item() - 1) < 0.05
    assert first.source.startswith("scikit-learn")


def test_synthetic_deterministic_with_natural_partition() -> None:
    a = load_dataset("synthetic", num_clients=8, seed=3, synthetic_alpha=0.5, synthetic_beta=0.5)
    b = load_dataset("synthetic", num_clients=8, seed=3, synthetic_alpha=0.5, synthetic_beta=0.5)
    c = load_dataset("synthetic", num_clients=8, seed=4, synthetic_alpha=0.5, synthetic_beta=0.5)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.x_train.shape != c.x_train.shape or not torch.equal(a.x_train, c.x_train)
    assert a.input_shape == (60,) and a.num_classes == 10 and a.x_train.dtype == torch.float32
    assert a.natural_partition is not None and len(a.natural_partition) == 8
    joined = np.concatenate(a.natural_partition)
    assert np.array_equal(np.sort(joined), np.arange(a.x_train.shape[0]))  # disjoint, covering
    assert all(len(p) >= 40 for p in a.natural_partition)
    assert a.x_test.shape[0] == pytest.approx(0.25 * a.x_train.shape[0], rel=0.05)
    assert torch.allclose(a.x_train.mean(0), torch.zeros(60), atol=1e-4)


@pytest.mark.skipif(
    not (REPO_ROOT.parent / "shared" / "data" / "mnist").is_dir(), reason="no offline MNIST copy"
)
def test_real_mnist_offline_copy() -> None:
    ds = load_dataset("mnist", REPO_ROOT.parent / "shared" / "data" / "mnist", download=False)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.y_train).tolist()[0] == 5923
    assert abs(ds.x_train.mean().item()) < 0.01 and abs(ds.x_train.std().item() - 1) < 0.01
