"""The node's model cache: its pure core (LRU within a budget, never what is in
use, digests) as tables, and staging as real file copying in a temporary directory."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading

import pytest

from llmgw.services.agent.modelcache import ENTRIES, INDEX, STAGING, Digest, Entry, ModelCache, evictions, stamp_of
from llmgw.services.agent.staging import Stager, WeightsUnavailable, copy_tree, resolve, scan
from llmgw.shared.errors import ConfigError
from llmgw.shared.schemas import DeploymentSpec, template_digest, weights_source
from llmgw.shared.specs import validate_spec

MiB = 1 << 20


def entries(*rows: tuple[str, int, float]) -> dict[str, Entry]:
    return {s: Entry(source=s, name=s, digest="", size=size, stamp="", last_use=used, staged_at=0.0) for s, size, used in rows}


# (entries (source, size, last use), need, budget, in use, reserved) -> what is evicted, None: cannot fit
EVICTIONS = [
    ("fits in what is free", entries(("a", 10, 1)), 5, 20, (), 0, []),
    ("fits exactly", entries(("a", 10, 1)), 10, 20, (), 0, []),
    ("least recently used goes first", entries(("a", 10, 3), ("b", 10, 1), ("c", 10, 2)), 10, 30, (), 0, ["b"]),
    ("as many as it takes, oldest first", entries(("a", 10, 3), ("b", 10, 1), ("c", 10, 2)), 20, 30, (), 0, ["b", "c"]),
    ("never one in use, however old", entries(("a", 10, 3), ("b", 10, 1), ("c", 10, 2)), 10, 30, ("b",), 0, ["c"]),
    ("ties broken by source", entries(("b", 10, 1), ("a", 10, 1)), 10, 20, (), 0, ["a"]),
    ("copies in progress hold room", entries(("a", 10, 1)), 10, 30, (), 15, ["a"]),
    ("in use and in progress leave too little", entries(("a", 10, 1), ("b", 10, 2)), 15, 30, ("a",), 10, None),
    ("all in use: cannot fit", entries(("a", 10, 1), ("b", 10, 2)), 15, 30, ("a", "b"), 0, None),
    ("bigger than the whole budget", {}, 31, 30, (), 0, None),
    ("an empty cache and room", {}, 30, 30, (), 0, []),
    ("the budget was lowered below what is held (need 0)", entries(("a", 10, 1), ("b", 10, 2)), 0, 15, (), 0, ["a"]),
]


@pytest.mark.parametrize(("held", "need", "budget", "in_use", "reserved", "expected"), [r[1:] for r in EVICTIONS], ids=[r[0] for r in EVICTIONS])
def test_evictions_are_lru_within_the_budget_and_never_in_use(held, need, budget, in_use, reserved, expected):
    got = evictions(held, need, budget, in_use, reserved)
    assert got == expected
    if got is not None:  # what is left fits, and nothing in use went
        left = sum(e.size for s, e in held.items() if s not in got)
        assert left + reserved + need <= budget
        assert not set(got) & set(in_use)


def digest_of(files: list[tuple[str, bytes]]) -> str:
    d = Digest()
    for rel, data in files:
        d.file(rel, len(data))
        d.data(data)
    return d.hexdigest()


DIGESTS = [
    ("same files, same digest", [("a", b"xy")], [("a", b"xy")], True),
    ("another byte", [("a", b"xy")], [("a", b"xz")], False),
    ("another name", [("a", b"xy")], [("b", b"xy")], False),
    ("a byte moved across a file boundary", [("a", b"x"), ("b", b"y")], [("a", b"xy"), ("b", b"")], False),
    ("an empty file more", [("a", b"xy")], [("a", b"xy"), ("b", b"")], False),
]


@pytest.mark.parametrize(("one", "other", "same"), [r[1:] for r in DIGESTS], ids=[r[0] for r in DIGESTS])
def test_the_digest_covers_names_sizes_and_bytes(one, other, same):
    assert (digest_of(one) == digest_of(other)) is same
    assert digest_of(one).startswith("sha256:")


def make_source(root, name: str, sizes: dict[str, int]) -> str:
    src = root / name
    for rel, size in sizes.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    return str(src)


def test_copy_tree_copies_every_byte_and_reports_progress_to_the_total(tmp_path):
    src = make_source(tmp_path, "m", {"config.json": 100, "shards/model-00001.safetensors": 3 * MiB + 5, "shards/model-00002.safetensors": MiB})
    files = scan(src)
    assert [f.rel for f in files] == ["config.json", "shards/model-00001.safetensors", "shards/model-00002.safetensors"]
    seen: list[int] = []
    dst = tmp_path / "copy"
    dst.mkdir()
    digest, size = copy_tree(src, files, str(dst), seen.append, threading.Event())
    total = sum(f.size for f in files)
    assert size == total and seen[-1] == total and seen == sorted(seen)
    for f in files:
        assert (dst / f.rel).read_bytes() == open(os.path.join(src, f.rel), "rb").read()
    assert digest == digest_of([(f.rel, open(os.path.join(src, f.rel), "rb").read()) for f in files])


def test_a_source_changed_under_the_copy_is_refused(tmp_path):
    src = make_source(tmp_path, "m", {"w.bin": 2 * MiB})
    files = scan(src)
    with open(os.path.join(src, "w.bin"), "ab") as f:
        f.write(b"more")
    (tmp_path / "copy").mkdir()
    with pytest.raises(OSError, match="changed while it was copied"):
        copy_tree(src, files, str(tmp_path / "copy"), lambda n: None, threading.Event())


def test_stamps_change_with_the_source(tmp_path):
    src = make_source(tmp_path, "m", {"w.bin": 10})
    before = stamp_of(scan(src))
    assert stamp_of(scan(src)) == before
    os.utime(os.path.join(src, "w.bin"), ns=(1, 1))
    assert stamp_of(scan(src)) != before


SOURCES = [
    ("a path", "/srv/models/llama", "", "", "path:/srv/models/llama", "/srv/models/llama"),
    ("a model id under the mirror", "", "meta/llama-8b", "/mnt/mirror", "model:meta/llama-8b", "/mnt/mirror/meta/llama-8b"),
]


@pytest.mark.parametrize(("path", "model", "mirror", "key", "where"), [r[1:] for r in SOURCES], ids=[r[0] for r in SOURCES])
def test_sources_resolve_on_the_node(path, model, mirror, key, where):
    s = resolve(path, model, mirror)
    assert (s.key, s.dir) == (key, where)


def test_sources_that_cannot_resolve_say_why(tmp_path):
    with pytest.raises(WeightsUnavailable, match=r"no cache\.mirror"):
        resolve("", "meta/llama", "")
    with pytest.raises(WeightsUnavailable, match="does not exist on this node"):
        scan(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsUnavailable, match="holds no files"):
        scan(str(tmp_path / "empty"))


# -- a deployment's weights source ------------------------------------------------

BAD_SOURCES = [
    ("both", dict(weights_path="/a", weights_model="b"), "are both set; give one"),
    ("relative path", dict(weights_path="models/x"), "is relative"),
    ("dotted path", dict(weights_path="/srv/../etc"), "not a plain absolute path; write it as '/etc'"),
    ("doubled slash", dict(weights_path="/srv//x"), "write it as '/srv/x'"),
    ("root", dict(weights_path="/"), "the whole file system"),
    ("climbing model id", dict(weights_model="../etc"), "is not a model id"),
    ("three parts", dict(weights_model="a/b/c"), "is not a model id"),
    ("hidden part", dict(weights_model="org/.x"), "is not a model id"),
]


@pytest.mark.parametrize(("fields", "words"), [r[1:] for r in BAD_SOURCES], ids=[r[0] for r in BAD_SOURCES])
def test_a_bad_weights_source_is_refused_at_apply_with_the_field_named(fields, words):
    spec = DeploymentSpec(name="d", model="m", engine="sim", replicas=1, gpus_per_node=1, **fields)
    with pytest.raises(ConfigError) as e:
        validate_spec(spec)
    assert words in str(e.value)
    assert str(e.value).startswith("weights_")


def test_a_weights_source_is_part_of_the_template_and_absent_changes_nothing():
    base = DeploymentSpec(name="d", model="m", engine="sim", replicas=1, gpus_per_node=1)
    # The digest of a deployment without a source is what it was before sources existed.
    legacy = hashlib.sha256(json.dumps(["m", "sim", 1, 1, [], []], separators=(",", ":")).encode()).hexdigest()[:16]
    assert template_digest(base) == legacy
    a = DeploymentSpec(name="d", model="m", engine="sim", replicas=1, gpus_per_node=1, weights_path="/srv/a")
    b = DeploymentSpec(name="d", model="m", engine="sim", replicas=1, gpus_per_node=1, weights_path="/srv/b")
    c = DeploymentSpec(name="d", model="m", engine="sim", replicas=1, gpus_per_node=1, weights_model="srv/a")
    assert len({template_digest(x) for x in (base, a, b, c)}) == 4
    assert weights_source("", "") == ""


# -- the cache directory and the stager, on real files ------------------------------


def test_opening_the_cache_drops_what_an_interrupted_agent_left(tmp_path):
    root = tmp_path / "cache"
    (root / STAGING / "half.1234").mkdir(parents=True)
    (root / STAGING / "half.1234" / "w.bin").write_bytes(b"x" * 10)
    (root / ENTRIES / "kept").mkdir(parents=True)
    (root / ENTRIES / "kept" / "w.bin").write_bytes(b"x" * 10)
    (root / ENTRIES / "stray").mkdir()
    rows = [
        dict(source="path:/kept", name="kept", digest="sha256:1", size=10, stamp="s", last_use=2.0, staged_at=1.0),
        dict(source="path:/gone", name="gone", digest="sha256:2", size=10, stamp="s", last_use=1.0, staged_at=1.0),
    ]
    (root / INDEX).write_text(json.dumps(rows))
    cache = ModelCache(str(root), budget=100)
    cache.open()
    assert list(cache.entries) == ["path:/kept"]
    assert sorted(os.listdir(root / ENTRIES)) == ["kept"] and os.listdir(root / STAGING) == []
    assert len(cache.dropped) == 3  # the half copy, the entry without files, the directory without entry
    assert [r["source"] for r in json.loads((root / INDEX).read_text())] == ["path:/kept"]


def test_opening_under_a_lowered_budget_evicts_the_least_recently_used(tmp_path):
    root = tmp_path / "cache"
    rows = []
    for name, used in (("old", 1.0), ("new", 2.0)):
        (root / ENTRIES / name).mkdir(parents=True)
        rows.append(dict(source=f"path:/{name}", name=name, digest="", size=10, stamp="", last_use=used, staged_at=0.0))
    (root / INDEX).write_text(json.dumps(rows))
    cache = ModelCache(str(root), budget=15)
    cache.open()
    assert list(cache.entries) == ["path:/new"] and os.listdir(root / ENTRIES) == ["new"]


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


async def test_the_stager_copies_evicts_lru_within_the_budget_and_spares_what_runs(tmp_path):
    sources = {n: make_source(tmp_path / "shared", n, {"w.bin": 2 * MiB, "config.json": 10}) for n in ("a", "b", "c", "d")}
    big = make_source(tmp_path / "shared", "big", {"w.bin": 5 * MiB})
    cache = ModelCache(str(tmp_path / "cache"), budget=5 * MiB)
    cache.open()
    running: set[str] = set()
    changes = []
    stager = Stager(cache, mirror="", in_use=lambda: set(running), on_change=lambda: changes.append(stager.report()), progress_interval=0.0)

    def src(n):
        return resolve(sources[n], "", "")

    first = await stager.ensure(src("a"))
    assert first.how == "staged" and not first.cached and first.dir == cache.path("path:" + sources["a"])
    assert (await stager.ensure(src("a"))).how == "hit"
    assert any(not e.complete and e.size == 2 * MiB + 10 for r in changes for e in r.entries)  # progress was reported
    running.add("path:" + sources["a"])  # an engine runs from a
    await stager.ensure(src("b"))
    cache.touch("path:" + sources["a"], at=0.0)  # a is the least recently used, but in use
    await stager.ensure(src("c"))  # 3 x 2 MiB > 5 MiB: b goes, not a
    assert set(cache.entries) == {"path:" + sources["a"], "path:" + sources["c"]}
    assert du(tmp_path / "cache") <= 5 * MiB + 4096  # the index file besides
    running.add("path:" + sources["c"])
    d = await stager.ensure(src("d"))  # a and c run: d cannot fit, its engine reads the source
    assert (d.how, d.dir) == ("uncached", sources["d"]) and "does not fit" in d.why
    assert (await stager.ensure(resolve(big, "", ""))).how == "uncached"
    assert set(cache.entries) == {"path:" + sources["a"], "path:" + sources["c"]}
    report = stager.report()
    assert report is not None and report.used == 2 * (2 * MiB + 10) and report.budget == 5 * MiB
    assert all(e.in_use and e.complete and e.digest.startswith("sha256:") for e in report.entries)


async def test_two_launches_of_one_source_share_one_copy_and_a_changed_source_is_copied_again(tmp_path):
    src = make_source(tmp_path, "m", {"w.bin": 4 * MiB})
    cache = ModelCache(str(tmp_path / "cache"), budget=64 * MiB)
    cache.open()
    stager = Stager(cache, mirror="", in_use=set, on_change=lambda: None)
    one, two = await asyncio.gather(stager.ensure(resolve(src, "", "")), stager.ensure(resolve(src, "", "")))
    assert one == two and one.how == "staged" and len(os.listdir(tmp_path / "cache" / ENTRIES)) == 1
    digest = cache.entries["path:" + src].digest
    fd = os.open(os.path.join(src, "w.bin"), os.O_WRONLY)
    os.write(fd, b"changed")
    os.close(fd)
    again = await stager.ensure(resolve(src, "", ""))
    assert again.how == "staged" and cache.entries["path:" + src].digest != digest
    os.rename(src, src + ".away")  # shared storage gone: the cached copy serves
    assert (await stager.ensure(resolve(src, "", ""))).how == "hit"
