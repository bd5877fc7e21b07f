"""The trainer's publish: a safetensors file written and hashed in one pass, on disk (file and directory flushed)
before it is renamed into place and announced; rank 0's background publisher, one version at a time, whose errors
reach the trainer; and a trainer killed mid-publish, which leaves no partial version where an actor or a resumed
trainer could find it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep_e2e.fixtures import wait_for
from lockstep_workers.weights import files as weights
from lockstep_workers.weights.files import Publisher, PublishFailed, local_path, newest_version, publish, version_path


def test_a_publish_hashes_what_it_writes_and_the_file_loads_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32, bf16, fp16, int and bool tensors, a 0-d one and an empty one, tied embeddings: the announced digest is
    the file's sha256, computed while writing (the file is never read back), and safetensors loads every tensor
    bit for bit; the lm_head tied to the embeddings is written once, as Hugging Face writes it."""
    generator = torch.Generator().manual_seed(3)
    embedding = torch.randn(16, 8, generator=generator)
    tensors = {
        "model.embed_tokens.weight": embedding,
        "lm_head.weight": embedding,
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 8, generator=generator).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=generator).to(torch.float16),
        "model.rotary_emb.inv_freq": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.25),
        "nothing": torch.empty(0, 3),
        "transposed": torch.randn(3, 5, generator=generator).t(),
    }

    def read_back(path: Path) -> str:
        raise AssertionError(f"publish read {path} back to hash it")

    monkeypatch.setattr(weights, "digest_of", read_back)
    announced = publish(tensors, tmp_path, version=4)
    path = local_path(announced)
    assert path == version_path(tmp_path, 4).resolve()
    assert announced.digest == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert announced.bytes == path.stat().st_size, "the announcement carries the version's size"
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors) - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape, name
        assert torch.equal(tensor, tensors[name]), name
    with pytest.raises(ValueError, match=r"tensor z has dtype torch.complex64, which the safetensors format cannot"):
        publish({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path, version=5)


def test_a_publish_writes_its_metadata_into_the_header_that_the_digest_covers(tmp_path: Path) -> None:
    """A LoRA version's header carries the adapter's config as ``__metadata__`` (lockstep_workers.weights.lora):
    safetensors reads it and the tensors back; another config is another digest; a non-string value is refused."""
    from safetensors import safe_open

    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
    }
    metadata = {"format": "pt", "adapter_config": '{"r": 4, "target_modules": ["q_proj"]}'}
    announced = publish(tensors, tmp_path, version=1, metadata=metadata)
    path = local_path(announced)
    assert announced.digest == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    with safe_open(str(path), framework="pt") as opened:
        assert opened.metadata() == metadata
        assert set(opened.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(opened.get_tensor(name), tensor), name
    other = publish(tensors, tmp_path, version=2, metadata={**metadata, "adapter_config": '{"r": 8}'})
    assert other.digest != announced.digest, "the digest covers the metadata"
    with safe_open(str(local_path(publish(tensors, tmp_path, version=3))), framework="pt") as opened:
        assert opened.metadata() is None, "no metadata unless given: full weights are written as before"
    with pytest.raises(ValueError, match=r"safetensors metadata maps strings to strings"):
        publish(tensors, tmp_path, version=4, metadata={"r": 4})  # type: ignore[dict-item]


def _layers(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    """Decoder-layer-like dicts of fp32 tensors, ``sizes`` elements each."""
    generator = torch.Generator().manual_seed(5)
    return [{f"model.layers.{n}.w": torch.randn(size, generator=generator)} for n, size in enumerate(sizes)]


def test_a_streamed_publish_writes_the_file_its_layers_make_as_they_arrive(tmp_path: Path) -> None:
    """The trainer's publish of a large model: the layers arrive one at a time after the header was written from
    their layout (meta tensors), and the file is the one a publish of them all at once would hash and load."""
    layers = _layers([10, 3, 7])
    layout = {name: torch.empty(t.shape, device="meta") for layer in layers for name, t in layer.items()}
    writing = weights.StreamedPublish(layout, tmp_path / "streamed", version=1, keep=3, limit=1)
    for layer in layers:
        writing.put(layer)
    writing.close()
    announced = writing.result()
    path = local_path(announced)
    assert announced.digest == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert writing.seconds is not None
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[name], t) for layer in layers for name, t in layer.items())
    assert len(loaded) == 3


def test_a_streamed_publish_holds_the_gather_while_its_buffer_is_full_and_never_blocks_it_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most ``limit`` bytes of gathered layers wait for the writer (and always one layer may): a layer handed
    over while the buffer is full waits until the writer took the one before. A writer that failed drops what comes
    after, so the gather, a collective of every rank, is never held; ``result`` raises the failure."""
    taken = threading.Event()
    release = threading.Event()

    def slow_writer(layout: object, layers: Iterator[dict[str, torch.Tensor]], *_: object) -> None:
        for number, _layer in enumerate(layers):
            taken.set()
            release.wait(30)
            if number == 1:
                raise OSError("disk full")

    monkeypatch.setattr(weights, "publish_layers", slow_writer)
    first, second, third = _layers([8, 8, 8])  # 32 bytes each
    writing = weights.StreamedPublish({}, tmp_path, version=1, keep=3, limit=40)
    writing.put(first)  # nothing waits: it may, whatever its size
    assert taken.wait(30), "the writer takes the first layer"
    held = threading.Thread(target=writing.put, args=(second,))
    held.start()
    held.join(0.5)
    assert held.is_alive(), "32 bytes wait (the layer being written), and 32 more would pass the 40-byte limit"
    release.set()
    held.join(30)
    assert not held.is_alive(), "the writer took the first layer's successor"
    writing.put(third)  # held until the writer fails on the second layer, then dropped
    writing.close()
    with pytest.raises(OSError, match="disk full"):
        writing.result()


def test_a_header_and_its_data_must_agree_and_align(tmp_path: Path) -> None:
    layer = {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"tensor b would start at byte 6, not aligned to its torch.float32"):
        weights.publish_layers(layer, [layer], tmp_path, version=1)
    layout = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"tensor b \(2,\) torch.float32 arrived where the header has a"):
        weights.publish_layers(layout, [{"b": torch.zeros(2), "a": torch.zeros(2)}], tmp_path, version=2)
    with pytest.raises(ValueError, match=r"the header's tensors \['b'\] \(of 1\) never arrived"):
        weights.publish_layers(layout, [{"a": torch.zeros(2)}], tmp_path, version=3)
    assert newest_version(tmp_path) is None, "no partial version counts"


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, float("nan")),
        (torch.float32, float("inf")),
        (torch.bfloat16, float("-inf")),
        (torch.float8_e4m3fn, float("nan")),  # no infinity in it
    ],
)
def test_a_publish_refuses_a_tensor_that_is_not_finite_naming_it_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, value: float
) -> None:
    """Issue 46 item 5: a NaN or an infinity, also in the last slice of a tensor checked in slices, stops the publish
    before its bytes are written; neither the version nor its temporary file is left."""
    monkeypatch.setattr(weights, "FINITE_CHECK_ELEMENTS", 4)
    poisoned = torch.zeros(3, 5)
    poisoned[2, 4] = value
    tensors = {"model.norm.weight": torch.ones(5), "lm_head.weight": poisoned.to(dtype), "ids": torch.arange(3)}
    with pytest.raises(weights.NonFiniteWeights, match=r"tensor lm_head.weight holds NaN or infinite values"):
        publish(tensors, tmp_path, version=4)
    assert list(tmp_path.iterdir()) == []
    publish({**tensors, "lm_head.weight": torch.zeros(3, 5).to(dtype)}, tmp_path, version=4)
    assert weights.non_finite_tensors(version_path(tmp_path, 4)) == []


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    assert weights.finite(torch.full((4,), 3e38)) and weights.finite(torch.full((4,), 3e38).to(torch.bfloat16))
    assert not weights.finite(torch.tensor([3e38, 3e38, float("nan")]))
    assert weights.finite(torch.arange(3)) and weights.finite(torch.empty(0))


def test_the_tensors_of_a_file_that_are_not_finite_are_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "v.safetensors"
    save_file({"a": torch.tensor([1.0, float("-inf")]), "b": torch.ones(2), "c": torch.tensor([float("nan")])}, path)
    assert weights.non_finite_tensors(path) == ["a", "c"]


def test_a_version_is_on_disk_before_its_name_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is flushed and fsynced under its hidden name, renamed, then its directory fsynced, all before
    publish returns what to announce."""
    events: list[str] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(descriptor: int) -> None:
        events.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{descriptor}')).name}")
        fsync(descriptor)

    def recorded_replace(source: Path, target: Path) -> None:
        events.append(f"rename {Path(source).name} -> {Path(target).name}")
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    publish({"w": torch.ones(4)}, tmp_path / "weights", version=1)
    assert events == [
        "fsync .v000001.safetensors.partial",
        "rename .v000001.safetensors.partial -> v000001.safetensors",
        "fsync weights",
    ]


def test_the_publisher_runs_one_publish_at_a_time_and_hands_on_its_error() -> None:
    publisher = Publisher()
    release = threading.Event()
    ran: list[int] = []

    def first() -> None:
        release.wait()
        ran.append(1)

    publisher.start(1, first)
    assert publisher.wait_for(0) == 0.0 and ran == [], "version 1 is not needed yet: no wait"
    threading.Timer(0.05, release.set).start()
    publisher.start(2, lambda: ran.append(2))  # waits for version 1 first
    assert ran[0] == 1
    publisher.wait()
    assert ran == [1, 2]

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    publisher.start(3, full_disk)
    with pytest.raises(PublishFailed, match=r"publishing weights version 3 failed: \[Errno 28\] No space left on"):
        publisher.start(4, lambda: ran.append(4))
    assert ran == [1, 2], "nothing started after the failure"
    publisher.start(3, full_disk)
    with pytest.raises(PublishFailed, match=r"version 3 failed"):
        publisher.wait_for(3)
    publisher.wait()  # the error was raised once, not again


KILLED_MID_PUBLISH = """
import os, sys, threading
from pathlib import Path
import torch
from lockstep_workers.weights.files import publish

directory, marker = Path(sys.argv[1]), Path(sys.argv[2])
publish({"w": torch.zeros(8)}, directory, version=1)
def blocked(descriptor):  # the bytes of version 2 are written, not yet on disk: the trainer is killed here
    marker.touch()
    threading.Event().wait()
os.fsync = blocked
publish({f"layer{n}": torch.ones(1 << 20) for n in range(16)}, directory, version=2)
"""


def test_a_trainer_killed_mid_publish_leaves_no_partial_version(tmp_path: Path) -> None:
    """A publisher SIGKILLed after writing version 2's 64 MiB and before they were on disk: no file by version 2's
    name, the newest version is still 1, and a resumed trainer goes on from version 1 (announced again)."""
    from lockstep_workers.trainer.model import Resumption, resumption

    directory, marker = tmp_path / "weights", tmp_path / "writing"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trainer = subprocess.Popen([sys.executable, "-c", KILLED_MID_PUBLISH, str(directory), str(marker)], env=environment)
    try:
        wait_for(lambda: marker.exists() or trainer.poll() is not None, "version 2 to be written", timeout=240)
        assert trainer.poll() is None, "the publisher ended before it was killed"
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait()
    assert sorted(p.name for p in directory.iterdir()) == [".v000002.safetensors.partial", "v000001.safetensors"]
    assert not version_path(directory, 2).exists() and newest_version(directory) == 1
    resumed = resumption(None, directory, tmp_path / "checkpoints")
    assert resumed == Resumption(2, version_path(directory, 1), None, weights.published(directory, 1))
