"""Verified loading: a truncated, altered, missing or swapped shard, a damaged metadata or
index, or a checkpoint of another model is refused with an error naming the file and the
reason; nothing in a checkpoint can run code (shards are safetensors, common.pt is read
with weights_only=True).

A 2-rank job saves the checkpoints; the damaged copies are made here; a 1-rank job (which
reads every shard, as a 2 -> 1 reshard) and a 2-rank job try to load them.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct

import pytest
import torch

from zero_core.checkpoint import store
from zero_core.checkpoint.store import CheckpointError
from zero_core.checkpoint.save_load import check_plain
from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_train.py")


def launch(tasks, nprocs):
    results = run_ranks(WORKER, nprocs, "torchrun", args=[json.dumps(tasks)],
                        env={"ZERO_CORE_COMM": "gloo", "ZERO_CORE_COMM_TIMEOUT": "60"},
                        timeout=600)
    return [r.report for r in results]


def tag_dir(d):
    return os.path.join(d, "step10")


def rewrite_metadata(d, edit):
    path = os.path.join(tag_dir(d), "metadata.json")
    with open(path) as fh:
        meta = json.load(fh)
    edit(meta)
    with open(path, "w") as fh:
        json.dump(meta, fh)


def sha(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def damage(src, dst, other, variant):
    shutil.copytree(src, dst)
    shard0 = os.path.join(tag_dir(dst), "rank_00000.safetensors")
    shard1 = os.path.join(tag_dir(dst), "rank_00001.safetensors")
    if variant == "truncated":
        with open(shard1, "r+b") as fh:
            fh.truncate(os.path.getsize(shard1) - 100)
    elif variant == "altered":
        with open(shard1, "r+b") as fh:
            fh.seek(os.path.getsize(shard1) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x01]))
    elif variant == "missing":
        os.remove(shard1)
    elif variant == "swapped":  # the same rank's shard of another checkpoint
        shutil.copy(os.path.join(tag_dir(other), "rank_00001.safetensors"), shard1)
    elif variant == "metadata":
        path = os.path.join(tag_dir(dst), "metadata.json")
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    elif variant == "index":  # a fragment claimed to end early: a gap
        rewrite_metadata(dst, lambda m: m["ranks"][1]["fragments"][0].__setitem__(
            2, m["ranks"][1]["fragments"][0][2] - 1))
    elif variant == "path":  # metadata naming a file outside the checkpoint
        rewrite_metadata(dst, lambda m: m["files"].__setitem__("../escape", m["files"].pop(
            "rank_00001.safetensors")))
    elif variant == "header":  # consistent checksum, inconsistent safetensors header
        with open(shard0, "rb") as fh:
            data = bytearray(fh.read())
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        header["master.float32"]["data_offsets"][1] += 4
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw)) if len(raw) <= n else b""
        assert len(raw) == n
        data[8:8 + n] = raw
        with open(shard0, "wb") as fh:
            fh.write(data)
        rewrite_metadata(dst, lambda m: m["files"]["rank_00000.safetensors"].update(
            sha256=sha(shard0), bytes=len(data)))
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    launch([["reshard_save", str(d / "ck"), 1], ["reshard_save", str(d / "other"), 1, "bf16"]], 2)
    return d


VARIANTS = {
    "truncated": ("rank_00001.safetensors", "truncated"),
    "altered": ("rank_00001.safetensors", "SHA-256"),
    "missing": ("rank_00001.safetensors", "missing"),
    "swapped": ("rank_00001.safetensors", ("SHA-256", "replaced")),
    "metadata": ("metadata.json", "not readable JSON"),
    "index": ("metadata.json", "cover"),
    "path": ("metadata.json", "not a plain file name"),
    "header": ("rank_00000.safetensors", "not a valid safetensors shard"),
}


@pytest.mark.multirank
def test_damaged_or_mismatched_checkpoints_are_refused(saved, tmp_path):
    tasks, expect = [], []
    for variant, (name, reason) in VARIANTS.items():
        d = damage(saved / "ck", tmp_path / variant, saved / "other", variant)
        tasks.append(["load_error", str(d), variant])
        expect.append((variant, name, reason))
    for variant, needle in (("wrong_shape", "has shape"), ("extra_layer", "'l3.weight'")):
        tasks.append(["load_error", str(saved / "ck"), variant])
        expect.append((variant, "metadata.json", ("different model", needle)))
    tasks.append(["load_error", str(saved / "ck"), "intact"])
    (reports,) = launch(tasks, 1)
    for (variant, _, _), rep in zip(expect, reports):
        print(f"{variant}: {rep['error']}")
    for (variant, name, reasons), rep in zip(expect, reports):
        msg = rep["error"]
        assert msg is not None, f"{variant}: loaded without error"
        assert name in msg, (variant, msg)
        reasons = (reasons,) if isinstance(reasons, str) else reasons
        if variant in ("wrong_shape", "extra_layer"):
            assert all(r in msg for r in reasons), (variant, msg)
        else:
            assert any(r in msg for r in reasons), (variant, msg)
    assert reports[-1]["error"] is None  # the intact original loads


@pytest.mark.multirank
def test_two_ranks_agree_when_one_shard_is_damaged(saved, tmp_path):
    d = damage(saved / "ck", tmp_path / "altered", saved / "other", "altered")
    r0, r1 = launch([["load_error", str(d), "altered"]], 2)
    assert "rank_00001.safetensors" in r1[0]["error"] and "SHA-256" in r1[0]["error"]
    assert "failed on another rank" in r0[0]["error"]  # rank 0's own shard was fine


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_common_file_never_runs_code(saved, tmp_path):
    """An attacker who rewrites common.pt AND its checksum still cannot run code."""
    d = tmp_path / "evil"
    shutil.copytree(saved / "ck", d)
    marker = tmp_path / "code_ran"
    common = os.path.join(tag_dir(d), "common.pt")
    with open(common, "wb") as fh:
        pickle.dump({"payload": _RunsCode(str(marker))}, fh)
    rewrite_metadata(d, lambda m: m["files"]["common.pt"].update(
        sha256=sha(common), bytes=os.path.getsize(common)))
    t, meta = store.read_metadata(str(d))
    with pytest.raises(CheckpointError, match="weights_only"):
        store.load_plain(t, "common.pt", meta)
    assert not marker.exists()
    with open(common, "rb") as fh:  # the payload is real: plain unpickling runs it
        pickle.load(fh)
    assert marker.exists()


def test_shards_are_standard_safetensors(saved):
    from safetensors.torch import load_file
    t = tag_dir(saved / "ck")
    for r in range(2):
        path = os.path.join(t, store.shard_name(r))
        ours = store.SafetensorsReader(path)
        theirs = load_file(path)
        assert sorted(theirs) == sorted(ours.tensors)
        for name, tensor in theirs.items():
            assert torch.equal(ours.read_tensor(name), tensor)
        ours.close()


def test_reader_refuses_malformed_headers(tmp_path):
    good = tmp_path / "good.safetensors"
    entries = [store.TensorEntry("a", torch.float32, (3,), lambda: [torch.arange(3.0)])]
    digest, size = store.write_safetensors(str(good), entries)
    assert digest == sha(good) and size == os.path.getsize(good)
    data = good.read_bytes()
    cases = {"short": data[:5], "huge_header": struct.pack("<Q", 2 ** 40) + data[8:],
             "not_json": data[:8] + b"{" * (len(data) - 8),
             "trailing": data + b"\0" * 4}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(blob)
        with pytest.raises(CheckpointError, match="not a valid safetensors shard"):
            store.SafetensorsReader(str(p))
    with store.SafetensorsReader(str(good)) as r:
        assert r.read("a", 1, 2).tolist() == [1.0, 2.0]
        with pytest.raises(CheckpointError, match="outside"):
            r.read("a", 2, 2)


def test_client_state_must_be_plain_data():
    check_plain({"step": 3, "gen": torch.zeros(3, dtype=torch.uint8), "t": (1.0, "x")}, "cs")
    with pytest.raises(CheckpointError, match=r"client_state\['sampler'\].*weights_only"):
        check_plain({"sampler": object()}, "client_state")


def test_tags_and_missing_latest(tmp_path):
    for bad in ("", "..", "a/b", ".hidden", "latest"):
        with pytest.raises(CheckpointError, match="not usable as a directory name"):
            store.resolve_tag(str(tmp_path), bad)
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        store.read_metadata(str(tmp_path))
    # a path that is no directory says so, rather than that 'latest' is missing
    with pytest.raises(CheckpointError, match="no_such_dir does not exist"):
        store.read_metadata(str(tmp_path / "no_such_dir"))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="a_file is a file, not a directory"):
        store.read_metadata(str(tmp_path / "a_file"))
