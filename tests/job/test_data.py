"""experiments/job/data.py: corpora, token files, splits, deterministic batches, errors."""

import itertools
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from experiments.job.data import TokenDataset, batches, default_corpus_files


def _dataset(n: int = 10_000, val_fraction: float = 0.01) -> TokenDataset:
    # tokens[i] == i: a window's first value is its offset.
    return TokenDataset(np.arange(n, dtype=np.uint16), vocab_size=n, val_fraction=val_fraction)


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory) -> TokenDataset:
    return TokenDataset.from_default_corpus(tmp_path_factory.mktemp("cache"))


def test_default_corpus_files_are_stdlib_sources_without_tests():
    files = default_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == default_corpus_files()  # deterministic
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    for r in rel:
        dirs = r.split("/")[:-1]
        assert not {"test", "tests", "site-packages"} & set(dirs), r
    assert "os.py" in rel and "json/__init__.py" in rel
    # every .py file under the library that no excluded folder holds, and no other
    expected = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if p.is_file()
        and not any(
            d in {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
            or d.endswith(("_test", "_tests"))
            for d in p.relative_to(root).parts[:-1]
        )
    )
    assert rel == expected


def test_default_corpus_is_cached_and_memory_mapped(stdlib_dataset):
    ds = stdlib_dataset
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.uint8
    assert ds.vocab_size == 256
    files = default_corpus_files()
    assert ds.tokens.size == sum(f.stat().st_size for f in files) + len(files) - 1
    # The concatenation starts with the first file and a 0 byte follows it.
    first = files[0].read_bytes()
    assert bytes(ds.tokens[: len(first)]) == first
    assert ds.tokens[len(first)] == 0


def test_text_files_concatenated_with_zero_separator_and_cache_reused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"hello")
    b.write_bytes("wörld\n".encode())
    cache = tmp_path / "cache"
    ds = TokenDataset.from_text_files([a, b], cache, val_fraction=0.0)
    expected = b"hello\0" + "wörld\n".encode()
    assert bytes(ds.tokens) == expected
    (cached,) = cache.glob("*.npy")
    np.testing.assert_array_equal(np.load(cached), np.frombuffer(expected, np.uint8))
    # A second build memory-maps the same cache file instead of writing another.
    again = TokenDataset.from_text_files([a, b], cache, val_fraction=0.0)
    assert isinstance(again.tokens, np.memmap) and Path(again.tokens.filename) == cached
    assert list(cache.iterdir()) == [cached]  # no temporary files left behind
    # Changing a file invalidates the cache key.
    b.write_bytes(b"changed!")
    changed = TokenDataset.from_text_files([a, b], cache, val_fraction=0.0)
    assert bytes(changed.tokens) == b"hello\0changed!"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_raw_token_file_is_memory_mapped(tmp_path, dtype):
    little_endian = np.dtype(dtype).newbyteorder("<")
    values = np.random.default_rng(0).integers(0, 50_000, size=5000).astype(little_endian)
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    ds = TokenDataset.from_token_file(path, dtype=dtype, vocab_size=50_000)
    assert isinstance(ds.tokens, np.memmap)
    np.testing.assert_array_equal(ds.tokens, values)
    _, batch = next(batches(ds, 4, 64, seed=0))
    assert batch.dtype == np.int32 and batch.min() >= 0 and batch.max() < 50_000


def test_npy_token_file(tmp_path):
    values = np.arange(3000, dtype=np.uint16)
    path = tmp_path / "tokens.npy"
    np.save(path, values)
    ds = TokenDataset.from_token_file(path)
    assert isinstance(ds.tokens, np.memmap)
    np.testing.assert_array_equal(ds.tokens, values)
    assert ds.vocab_size is None


def test_validation_split_is_the_disjoint_last_percent():
    ds = _dataset(10_000)
    assert ds.train.size == 9900 and ds.val.size == 100
    assert np.shares_memory(ds.train, ds.tokens)  # views, not copies
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), ds.tokens)
    # Every window of each split comes from its own index range.
    for split, lo, hi in (("train", 0, 9900), ("val", 9900, 10_000)):
        _, batch = next(batches(ds, 16, 50, seed=1, split=split))
        for row in batch:
            np.testing.assert_array_equal(row, np.arange(row[0], row[0] + 50))  # contiguous
            assert lo <= row[0] and row[0] + 50 <= hi, (split, row[0])


def test_batches_are_deterministic_and_resumable(stdlib_dataset):
    ds = stdlib_dataset
    fresh = list(itertools.islice(batches(ds, 4, 128, seed=7), 6))
    again = list(itertools.islice(batches(ds, 4, 128, seed=7), 6))
    resumed = list(itertools.islice(batches(ds, 4, 128, seed=7, start_step=3), 3))
    for (s1, b1), (s2, b2) in zip(fresh, again, strict=True):
        assert s1 == s2
        np.testing.assert_array_equal(b1, b2)
    assert [s for s, _ in fresh] == list(range(6))
    assert [s for s, _ in resumed] == [3, 4, 5]
    for (s1, b1), (s2, b2) in zip(fresh[3:], resumed, strict=True):
        assert s1 == s2
        np.testing.assert_array_equal(b1, b2)
    # Different steps and different seeds give different batches.
    assert not np.array_equal(fresh[0][1], fresh[1][1])
    other = next(batches(ds, 4, 128, seed=8))[1]
    assert not np.array_equal(fresh[0][1], other)


def test_batch_shape_dtype_and_token_range(stdlib_dataset):
    for _, batch in batches(stdlib_dataset, 8, 256, seed=0, end_step=3):
        assert batch.shape == (8, 256) and batch.dtype == np.int32
        assert batch.min() >= 0 and batch.max() < 256


def test_end_step_stops_the_iterator():
    assert [s for s, _ in batches(_dataset(), 2, 8, seed=0, start_step=5, end_step=8)] == [5, 6, 7]


def test_missing_files_raise_with_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"text file .*nope.txt does not exist; fix"):
        TokenDataset.from_text_files([missing], tmp_path)
    with pytest.raises(FileNotFoundError, match=r"token file .*nope.bin does not exist; pass"):
        TokenDataset.from_token_file(tmp_path / "nope.bin")


def test_empty_corpus_raises(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"corpus is empty: 2 files with 0 bytes"):
        TokenDataset.from_text_files([empty, empty], tmp_path)
    with pytest.raises(ValueError, match=r"corpus is empty: 0 text files"):
        TokenDataset.from_text_files([], tmp_path)
    raw = tmp_path / "empty.bin"
    raw.write_bytes(b"")
    with pytest.raises(ValueError, match=r"corpus is empty: token file .* 0 bytes"):
        TokenDataset.from_token_file(raw)


def test_token_file_errors(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"has 3 bytes, not a multiple of 2 \(uint16\)"):
        TokenDataset.from_token_file(odd)
    path = tmp_path / "big.bin"
    np.array([1, 2, 300], dtype="<u2").tofile(path)
    with pytest.raises(ValueError, match=r"contains token id 300 >= vocab_size=256"):
        TokenDataset.from_token_file(path, vocab_size=256)
    signed = tmp_path / "signed.npy"
    np.save(signed, np.arange(10, dtype=np.int64))
    with pytest.raises(ValueError, match=r"holds int64 tokens"):
        TokenDataset.from_token_file(signed)
    with pytest.raises(ValueError, match=r"dtype must be 'uint16' or 'uint32', got 'int8'"):
        TokenDataset.from_token_file(odd, dtype="int8")


def test_seq_len_longer_than_split_raises_with_numbers():
    ds = _dataset(1000)  # 990 train, 10 val tokens
    with pytest.raises(ValueError, match=r"seq_len=991 is longer than the train split \(990 "):
        batches(ds, 1, 991, seed=0)
    with pytest.raises(ValueError, match=r"seq_len=11 is longer than the val split \(10 tokens"):
        batches(ds, 1, 11, seed=0, split="val")
    with pytest.raises(ValueError, match=r"split must be 'train' or 'val', got 'test'"):
        batches(ds, 1, 4, seed=0, split="test")
    with pytest.raises(ValueError, match=r"batch_size=0 and seq_len=4 must be positive"):
        batches(ds, 0, 4, seed=0)
