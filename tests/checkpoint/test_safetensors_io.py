"""The streaming safetensors writer against the safetensors library itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from magistral_cli.checkpoint.safetensors_io import (
    SafetensorsStreamWriter,
    StreamWriters,
    TensorSpec,
    read_safetensors_header,
    safetensors_dtype,
)
from magistral_cli.errors import UserError


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.weight": torch.randn(4, 4, generator=g),
        "c.index": torch.arange(7, dtype=torch.int64),
        "d.scale": torch.tensor(1.5),  # 0-d
        "e.half": torch.randn(2, 3, 1, generator=g).half(),
        "f.empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }


def test_stream_writer_matches_save_file_byte_for_byte(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    specs = [TensorSpec(k, safetensors_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    writer = SafetensorsStreamWriter(tmp_path / "ours.safetensors", specs, metadata={"format": "pt"})
    for key in reversed(list(tensors)):  # arrival order does not matter
        writer.write(key, tensors[key])
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    loaded = load_file(tmp_path / "ours.safetensors")
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_header_is_read_without_data(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    specs, metadata = read_safetensors_header(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"}
    assert {s.name: (s.torch_dtype(), s.shape) for s in specs} == {
        k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()
    }


def test_writer_refuses_wrong_tensors_and_incomplete_files(tmp_path):
    spec = TensorSpec("w", "BF16", (2, 2))
    writer = SafetensorsStreamWriter(tmp_path / "w.safetensors", [spec, TensorSpec("v", "F32", (1,))])
    with pytest.raises(ValueError, match="header says BF16"):
        writer.write("w", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="unexpected or repeated"):
        writer.write("nope", torch.zeros(1))
    writer.write("w", torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unexpected or repeated"):
        writer.write("w", torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1 tensors never written"):
        writer.close()


def test_truncated_file_is_a_user_error(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        read_safetensors_header(tmp_path / "bad.safetensors")


def test_row_blocks_complete_a_tensor(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_file({"w": full}, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    writer = SafetensorsStreamWriter(
        tmp_path / "rows.safetensors", [TensorSpec("w", "F32", (6, 4))], {"format": "pt"}
    )
    writer.write("w", full[4:], row_offset=4)
    with pytest.raises(ValueError, match="at row 5"):
        writer.write("w", full[:2], row_offset=5)  # would run past the last row
    writer.write("w", full[:4], row_offset=0)
    writer.close()
    assert (tmp_path / "rows.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("sync_every", [None, 16], ids=["at-the-last-byte", "also-while-filling"])
def test_early_sync_starts_when_the_last_byte_is_in_and_keeps_the_bytes(tmp_path, monkeypatch, sync_every):
    """``sync_early``: the fsync is submitted once every byte of the file is written (an empty
    tensor never written does not hold it back), and an fdatasync of what is written so far after
    every ``SYNC_EVERY`` bytes (one at a time), so a large file is written out while it fills;
    close waits for all of them; the file is unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    from magistral_cli.checkpoint import safetensors_io

    if sync_every:
        monkeypatch.setattr(safetensors_io, "SYNC_EVERY", sync_every)
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    specs = [TensorSpec(k, safetensors_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with ThreadPoolExecutor(1) as pool:
        writer = SafetensorsStreamWriter(
            tmp_path / "ours.safetensors", specs, metadata={"format": "pt"}, sync_early=pool
        )
        written = [k for k in tensors if k != "f.empty"]
        for key in written[:-1]:
            if writer._partial:  # let each one finish, so that the next may start
                writer._partial[-1].result()
            writer.write(key, tensors[key])
        assert writer._synced is None  # bytes still to come
        assert bool(writer._partial) == bool(sync_every)  # synced in part (only small files here)
        writer.write(written[-1], tensors[written[-1]])
        assert writer._synced is not None
        writer.close(fsync=True)
        assert all(s.done() and s.exception() is None for s in [*writer._partial, writer._synced])
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_stream_writers_sync_a_file_while_the_next_fills_and_close_all_at_the_end(tmp_path):
    """``StreamWriters(fsync=True)``: a finished file's sync starts before the next file is opened,
    every file stays open until the block ends, and then each is complete and equal to save_file's."""
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    specs = [TensorSpec(k, safetensors_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with StreamWriters(fsync=True) as group:
        writers = []
        for name in ("one.safetensors", "two.safetensors"):
            writer = group.open(tmp_path / name, specs, metadata={"format": "pt"})
            for key, tensor in tensors.items():
                writer.write(key, tensor)
            assert writer._synced is not None  # syncing in the background, the file still open
            writers.append(writer)
        assert all(w._fd >= 0 for w in writers)
    assert all(w._fd == -1 and w._synced.done() for w in writers)
    for name in ("one.safetensors", "two.safetensors"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_stream_writers_abort_every_file_on_an_error(tmp_path):
    """An error in the block (here an incomplete second file found at close) closes every file
    without further checks and propagates."""
    tensors = _tensors()
    specs = [TensorSpec(k, safetensors_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with pytest.raises(ValueError, match="never written"), StreamWriters(fsync=True) as group:
        first = group.open(tmp_path / "one.safetensors", specs)
        for key, tensor in tensors.items():
            first.write(key, tensor)
        second = group.open(tmp_path / "two.safetensors", specs)
        second.write("a.weight", tensors["a.weight"])
    assert first._fd == -1 and second._fd == -1


@pytest.mark.parametrize("src_offset, dst_offset", [(64, 1000), (4096 + 8, 8), (0, 0)])
def test_range_copy_gives_the_same_bytes_aligned_or_not(tmp_path, src_offset, dst_offset):
    """Offsets at different places in their pages go through the buffer, the same place through
    copy_file_range: the bytes that arrive are the source's either way, across several buffers."""
    import os

    from magistral_cli.checkpoint import safetensors_io

    data = os.urandom(3 * (1 << 20) + 12345)
    (tmp_path / "src").write_bytes(b"\0" * src_offset + data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o644)
    spare = os.open(tmp_path / "spare", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        safetensors_io._copy_file_range(src, src_offset, dst, dst_offset, len(data))
        with pytest.raises(ValueError, match="short"):  # the source ends 10 bytes early
            safetensors_io._copy_file_range(src, src_offset + 10, spare, dst_offset, len(data))
    finally:
        for fd in (src, dst, spare):
            os.close(fd)
    assert (tmp_path / "dst").read_bytes()[dst_offset:] == data
