"""dist_eval.backends.provenance: the servers of a run from petals' routing table (its real
ServerInfo and RemoteModuleInfo), identical replicas or not, and the summary's warning."""
import importlib
import os

from dist_eval.backends.petals.shims import import_petals
from dist_eval.backends.provenance import replicas_warning, swarm_provenance

import_petals()  # petals 2.2 meets hivemind 1.1.12
ds = importlib.import_module("petals.data_structures")


def server(start, end, dtype="float32", quant="none", version="2.2.0.post1", state="ONLINE"):
    return ds.ServerInfo(state=getattr(ds.ServerState, state), throughput=1.0, start_block=start, end_block=end,
                         version=version, torch_dtype=dtype, quant_type=quant)


def table(assignments):
    """assignments: {peer: ServerInfo}; each server on its [start, end) blocks of 4."""
    return [ds.RemoteModuleInfo(f"m.{b}", {p: i for p, i in assignments.items() if i.start_block <= b < i.end_block})
            for b in range(4)]


def test_identical_replicas_are_recorded_with_their_facts():
    got = swarm_provenance(table({"peerA": server(0, 4), "peerB": server(0, 2), "peerC": server(2, 4)}))
    assert got["identical_replicas"] and got["mixed_blocks"] == []
    by_peer = {s["peer_id"]: s for s in got["servers"]}
    assert set(by_peer) == {"peerA", "peerB", "peerC"}
    assert by_peer["peerC"]["blocks"] == [2, 4] and by_peer["peerA"]["blocks"] == [0, 4]
    assert by_peer["peerB"]["petals_version"] == "2.2.0.post1" and by_peer["peerB"]["torch_dtype"] == "float32"
    assert by_peer["peerB"]["quantization"] == "none" and by_peer["peerB"]["state"] == "online"
    assert replicas_warning({"swarm": got}) == ""


def test_differing_replicas_are_named_and_warned_about_in_one_line():
    got = swarm_provenance(table({"a": server(0, 4), "b": server(2, 4, dtype="bfloat16", quant="nf4")}))
    assert not got["identical_replicas"] and got["mixed_blocks"] == [2, 3]
    line = replicas_warning({"swarm": got})
    assert "\n" not in line and "[2, 3]" in line and "route" in line
    assert replicas_warning({}) == ""  # the local backend: nothing to say


def test_offline_servers_do_not_count():
    got = swarm_provenance(table({"a": server(0, 4), "b": server(0, 4, quant="nf4", state="OFFLINE")}))
    assert got["identical_replicas"] and [s["peer_id"] for s in got["servers"]] == ["a"]


def test_dist_eval_servers_mark_their_version_and_match_stock_replicas():
    """A dist_eval server's marked version and a stock server's are the same blocks for a model
    both compute; a newer family's model refuses the stock one (backends.blocks)."""
    from dist_eval.backends.blocks import SERVER_VERSION_MARK
    from dist_eval.backends.provenance import servers_without_block_options

    ours = server(0, 4, version="2.2.0.post1" + SERVER_VERSION_MARK)
    got = swarm_provenance(table({"peerA": ours, "peerB": server(0, 4)}))
    assert got["identical_replicas"]
    assert servers_without_block_options(table({"peerA": ours, "peerB": server(0, 4),
                                                "peerC": server(0, 4, state="OFFLINE")})) == [("peerB", "2.2.0.post1")]
    assert servers_without_block_options(table({"peerA": ours})) == []


def test_a_family_of_dist_evals_own_layers_refuses_a_swarm_with_stock_servers():
    """Qwen3 / Qwen3-MoE blocks are dist_eval's layers: a server that is not dist_eval's (its
    version unmarked) would not compute them, so the client refuses the swarm in one line."""
    import types

    import pytest

    from dist_eval.backends.blocks import SERVER_VERSION_MARK
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.backend import _require_block_options
    from dist_eval.errors import UsageError

    ours = server(0, 4, version="2.2.0.post1" + SERVER_VERSION_MARK)
    for name in ("qwen3", "qwen3_moe", "glm4_moe", "mixtral"):
        config = types.SimpleNamespace(model_type=name)
        for servers, refused in (({"peerA": ours}, False), ({"peerA": ours, "peerStock": server(2, 4)}, True)):
            manager = types.SimpleNamespace(state=types.SimpleNamespace(
                sequence_info=types.SimpleNamespace(block_infos=table(servers))))
            if not refused:
                _require_block_options(manager, FAMILIES[name], config)
                continue
            with pytest.raises(UsageError) as e:
                _require_block_options(manager, FAMILIES[name], config)
            assert "\n" not in str(e.value) and "peerStock... (petals 2.2.0.post1) are not dist_eval's" in str(e.value)
            assert f"this {name} model's blocks need dist_eval's block options" in str(e.value)


def test_a_falcon_of_another_rope_theta_refuses_stock_servers_and_an_older_dist_evals():
    """petals 2.2's Falcon block computes RoPE at base 10000 whatever rope_theta says (dist_eval's servers at
    rope_theta: tests/test_families_reference.py): a Falcon of another rope_theta refuses a swarm with a stock
    server, or one of an older dist_eval (blocks1 computed it as petals does); one of theta 10000 takes both."""
    import types

    import pytest

    from dist_eval.backends.blocks import SERVER_VERSION_MARK
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.backend import _require_block_options
    from dist_eval.errors import UsageError

    ours, older = (server(0, 4, version="2.2.0.post1" + mark) for mark in (SERVER_VERSION_MARK, "+dist_eval.blocks1"))
    for other in (server(2, 4), older):
        manager = types.SimpleNamespace(state=types.SimpleNamespace(
            sequence_info=types.SimpleNamespace(block_infos=table({"peerA": ours, "peerOther": other}))))
        _require_block_options(manager, FAMILIES["falcon"], types.SimpleNamespace(rope_theta=10000.0))
        with pytest.raises(UsageError) as e:
            _require_block_options(manager, FAMILIES["falcon"], types.SimpleNamespace(rope_theta=500042.0))
        assert "\n" not in str(e.value) and "peerOther... (petals 2.2.0.post1" in str(e.value)
        assert "without its config.json's rope_theta 500042.0 (their block's RoPE base is always 10000)" \
            in str(e.value)
        assert "servers_started_from_4x_config" not in str(e.value)  # not a question of the config's form


def _big_file(path, size):
    """A sparse file of ``size`` bytes with a few bytes of its own at the start and the end."""
    with open(path, "wb") as f:
        f.write(b"head")
        f.truncate(size)
        f.seek(size - 4)
        f.write(b"tail")
    return str(path)


def test_a_big_weight_file_changed_mid_file_with_its_mtime_set_back_gets_another_digest(tmp_path, monkeypatch):
    """Issue 50. Before: a file over 64 MiB was known by its size, mtime and first and last MiB, so a
    rebuilt model with a change mid-file and normalised mtimes kept its key (and its stored rows).
    Now it is hashed whole; the digest kept in the cache is looked up by (device, inode, size,
    mtime, ctime), and setting an mtime back sets the ctime to now."""
    import hashlib
    import time

    from dist_eval.backends.provenance import WHOLE_HASH_BYTES, file_digest, folder_identity

    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    path = _big_file(folder / "model.safetensors", WHOLE_HASH_BYTES + (3 << 20))
    before = folder_identity(str(folder))
    digest = file_digest(path)
    stat = os.stat(path)
    time.sleep(0.01)  # a ctime of its own (file systems keep ns; some tick coarser)
    with open(path, "r+b") as f:  # one byte in the middle, then the mtime as it was
        f.seek(stat.st_size // 2)
        f.write(b"\x01")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and os.stat(path).st_size == stat.st_size
    changed = file_digest(path)
    assert changed != digest and folder_identity(str(folder)) != before
    assert changed == hashlib.sha256(open(path, "rb").read()).hexdigest()  # hashed whole
    assert (tmp_path / "cache" / "file_digests.json").is_file()


def test_the_digest_of_a_big_file_is_read_from_the_cache_and_a_bad_cache_is_ignored(tmp_path, monkeypatch):
    import json

    from dist_eval.backends.provenance import WHOLE_HASH_BYTES, file_digest

    cache = tmp_path / "cache"
    monkeypatch.setenv("DIST_EVAL_CACHE", str(cache))
    path = _big_file(tmp_path / "w.bin", WHOLE_HASH_BYTES + 1)
    digest = file_digest(path)
    kept = json.loads((cache / "file_digests.json").read_text())["sha256"]
    assert list(kept.values()) == [digest]
    # the cache is what a later start reads: a digest put there is the one given (nothing hashed)
    (cache / "file_digests.json").write_text(json.dumps({"sha256": {k: "ab" * 32 for k in kept}}))
    assert file_digest(path) == "ab" * 32
    for bad in (b"\x00garbage", b"[1, 2]", json.dumps({"sha256": {k: "not a digest" for k in kept}}).encode()):
        (cache / "file_digests.json").write_bytes(bad)
        assert file_digest(path) == digest
    (cache / "file_digests.json").unlink()
    os.mkfifo(cache / "file_digests.json")  # a reader that would block: skipped at once
    assert file_digest(path) == digest


def test_dist_evals_version_says_which_code_computed_a_row(tmp_path, monkeypatch):
    """metrics.json's dist_eval version, which the shards' merge compares, and the resume's key carry a digest of
    the package's code: a one-line change of a module (another RoPE, say) is another version, though the
    metadata's version stays; the same files are the same version; bytecode, an editor's lock or a notebook's
    checkpoints are not code (a checkout's and an install's digests agree)."""
    import shutil
    from importlib import metadata

    import dist_eval
    from dist_eval.backends import provenance
    from dist_eval.config import Settings
    from dist_eval.resume import run_key

    package = os.path.dirname(dist_eval.__file__)
    copy = tmp_path / "dist_eval"
    shutil.copytree(package, copy, ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                                 and not os.path.isdir(os.path.join(folder, n))])
    assert provenance.code_digest(str(copy)) == provenance.code_digest(package)
    # not code: bytecode, an editor's lock (a dangling link), a notebook's checkpoint
    (copy / "backends" / "__pycache__").mkdir(exist_ok=True)
    (copy / "backends" / "__pycache__" / "rope.cpython-311.pyc").write_bytes(b"stale")
    os.symlink("nobody@host.1234", copy / "backends" / ".#rope.py")
    (copy / ".ipynb_checkpoints").mkdir()
    (copy / ".ipynb_checkpoints" / "rope-checkpoint.py").write_text("x = 1\n")
    assert provenance.code_digest(str(copy)) == provenance.code_digest(package)
    rope = copy / "backends" / "rope.py"
    rope.write_text(rope.read_text() + "\n# another RoPE\n")
    assert provenance.code_digest(str(copy)) != provenance.code_digest(package)

    version = provenance.dist_eval_version()
    assert version.split("+src.") == [dist_eval.__version__, provenance.code_digest(package)[:12]]
    assert dist_eval.__version__ == metadata.version("dist_eval")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    dataset = type("D", (), {"_fingerprint": "f", "column_names": ["text", "label"], "__len__": lambda self: 3})()
    model = type("M", (), {"backend": "local", "num_labels": 3, "prompt_tokens": 0})()
    key = run_key(str(tmp_path / "model"), None, dataset, None, model, Settings())
    monkeypatch.setattr(provenance, "dist_eval_version", lambda: version.replace("+src.", "+src.0"))
    assert run_key(str(tmp_path / "model"), None, dataset, None, model, Settings()) != key
