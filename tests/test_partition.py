"""Partitioning schemes: coverage, determinism, skew, FedFC class layouts, shard files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sfl_core.data.partition import (
    SCHEMES,
    class_groups,
    class_pairs,
    label_counts,
    load_shard_file,
    partition_indices,
    save_shard_file,
    shard_for_agent,
)

# 10 classes, unequal sizes (600..1050), shuffled: like a real training set's labels
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(10), np.arange(600, 1100, 50)))


def assert_disjoint(shards, total=None):
    allidx = np.concatenate(shards)
    assert np.unique(allidx).size == allidx.size, "an index is used twice"
    for s in shards:
        assert s.dtype == np.int64 and np.all(np.diff(s) > 0)
    if total is not None:
        assert np.array_equal(np.sort(allidx), np.arange(total)), "not a partition of the whole set"


def mean_entropy(shards, labels, k=10):
    ents = []
    for s in shards:
        p = np.bincount(labels[s], minlength=k) / len(s)
        p = p[p > 0]
        ents.append(-(p * np.log(p)).sum())
    return float(np.mean(ents))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "data-imbalance"])
@pytest.mark.parametrize("n", [1, 3, 4, 10])
def test_complete_partition(scheme, n):
    shards = partition_indices(LABELS, n, scheme, seed=1)
    assert len(shards) == n
    assert_disjoint(shards, total=len(LABELS))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_deterministic_and_seeded(scheme):
    a = partition_indices(LABELS, 8, scheme, seed=5, alpha=0.3)
    b = partition_indices(LABELS, 8, scheme, seed=5, alpha=0.3)
    c = partition_indices(LABELS, 8, scheme, seed=6, alpha=0.3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_even_and_balanced():
    shards = partition_indices(LABELS, 7, "iid")
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    # every agent sees every class in roughly the global proportion
    glob = np.bincount(LABELS) / len(LABELS)
    for s in shards:
        assert np.abs(np.bincount(LABELS[s], minlength=10) / len(s) - glob).max() < 0.05


def test_dirichlet_skew_grows_as_alpha_shrinks():
    ent = {a: np.mean([mean_entropy(partition_indices(LABELS, 10, "dirichlet", alpha=a, seed=s), LABELS)
                       for s in range(3)]) for a in (0.1, 1.0, 100.0)}
    assert ent[0.1] < ent[1.0] < ent[100.0]
    assert ent[100.0] > 0.95 * np.log(10)  # nearly uniform
    assert ent[0.1] < 0.5 * np.log(10)  # a few classes per agent


def test_dirichlet_min_size_and_impossible():
    shards = partition_indices(LABELS, 20, "dirichlet", alpha=0.5, min_size=50, seed=2)
    assert min(len(s) for s in shards) >= 50
    assert_disjoint(shards, total=len(LABELS))
    with pytest.raises(ValueError, match="could not give each of 5 agents"):
        partition_indices(np.arange(10) % 2, 5, "dirichlet", alpha=0.5, min_size=3)


def test_data_imbalance_shares():
    shards = partition_indices(LABELS, 4, "data-imbalance", seed=0)
    frac = np.array([len(s) for s in shards]) / len(LABELS)
    np.testing.assert_allclose(frac, [0.4, 0.3, 0.2, 0.1], atol=0.002)
    # only quantity differs: each agent keeps the global label mix
    glob = np.bincount(LABELS) / len(LABELS)
    for s in shards:
        assert np.abs(np.bincount(LABELS[s], minlength=10) / len(s) - glob).max() < 0.01
    frac3 = np.array([len(s) for s in partition_indices(LABELS, 3, "data-imbalance")]) / len(LABELS)
    np.testing.assert_allclose(frac3, [3 / 6, 2 / 6, 1 / 6], atol=0.002)


def test_class_imbalance_groups():
    assert class_groups(10) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [7, 8, 9]]
    g100 = class_groups(100)
    assert g100[0] == list(range(0, 30)) and g100[3] == list(range(70, 100))
    assert set().union(*map(set, g100)) == set(range(100))
    assert set().union(*map(set, class_groups(4))) == set(range(4))
    with pytest.raises(ValueError, match="num_classes >= 4"):
        class_groups(3)

    shards = partition_indices(LABELS, 4, "class-imbalance", seed=0)
    assert_disjoint(shards, total=len(LABELS))  # 4 agents hold all groups -> complete
    counts = np.bincount(LABELS)
    for i, s in enumerate(shards):
        assert sorted(set(LABELS[s].tolist())) == class_groups(10)[i]
    # shared classes 2 and 4 are split in half between their two holders
    for c, (a, b) in {2: (0, 1), 4: (1, 2)}.items():
        na, nb = (np.sum(LABELS[shards[a]] == c), np.sum(LABELS[shards[b]] == c))
        assert na + nb == counts[c] and abs(na - nb) <= 1
    # unshared classes go whole to their single holder
    assert np.sum(LABELS[shards[3]] == 8) == counts[8]


def test_class_imbalance_many_agents_wraps():
    shards = partition_indices(LABELS, 9, "class-imbalance", seed=0)
    assert_disjoint(shards, total=len(LABELS))
    for i, s in enumerate(shards):
        assert set(LABELS[s].tolist()) == set(class_groups(10)[i % 4])
    # class 0 is held by agents 0, 4, 8 in three near-equal parts
    parts = [np.sum(LABELS[shards[a]] == 0) for a in (0, 4, 8)]
    assert sum(parts) == np.sum(LABELS == 0) and max(parts) - min(parts) <= 1


def test_class_imbalance_few_agents_leaves_classes_out():
    shards = partition_indices(LABELS, 2, "class-imbalance")
    assert_disjoint(shards)
    held = set(LABELS[np.concatenate(shards)].tolist())
    assert held == {0, 1, 2, 3, 4}
    assert len(np.concatenate(shards)) == np.isin(LABELS, [0, 1, 2, 3, 4]).sum()


def test_extreme_pairs():
    assert class_pairs(10) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert class_pairs(5) == [[0, 1], [2, 3, 4]]
    shards = partition_indices(LABELS, 10, "extreme", seed=0)
    assert_disjoint(shards, total=len(LABELS))
    for i, s in enumerate(shards):
        assert set(LABELS[s].tolist()) == set(class_pairs(10)[i % 5])
    # agents i and i+5 share a pair and split it
    for i in range(5):
        assert len(shards[i]) + len(shards[i + 5]) == np.isin(LABELS, class_pairs(10)[i]).sum()
        assert abs(len(shards[i]) - len(shards[i + 5])) <= 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="iid, dirichlet, data-imbalance, class-imbalance, extreme"):
        partition_indices(LABELS, 4, "random")
    with pytest.raises(ValueError, match="num_agents"):
        partition_indices(LABELS, 0)
    with pytest.raises(ValueError, match="alpha"):
        partition_indices(LABELS, 4, "dirichlet", alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        partition_indices(LABELS, 4, "dirichlet", alpha=-1)
    with pytest.raises(ValueError, match="integers"):
        partition_indices(LABELS.astype(float), 4)
    with pytest.raises(ValueError, match="num_classes=5"):
        partition_indices(LABELS, 4, num_classes=5)
    with pytest.raises(ValueError, match="min_size"):
        partition_indices(np.arange(3), 4, "iid")


def test_label_counts_and_shard_for_agent():
    assert label_counts(np.array([0, 2, 2, 1, 2]), 4) == [1, 1, 3, 0]
    assert label_counts(LABELS, 10) == list(range(600, 1100, 50))
    with pytest.raises(ValueError):
        label_counts(np.array([0, 5]), 3)
    shards = partition_indices(LABELS, 6, "dirichlet", alpha=0.2, seed=9)
    for i in range(6):
        assert np.array_equal(shard_for_agent(LABELS, i, 6, "dirichlet", alpha=0.2, seed=9), shards[i])
    with pytest.raises(ValueError, match="agent_index"):
        shard_for_agent(LABELS, 6, 6, "iid")


@pytest.mark.parametrize("suffix", [".json", ".npy"])
def test_shard_file_round_trip(tmp_path, suffix):
    idx = partition_indices(LABELS, 3, "iid")[1]
    path = tmp_path / f"shard{suffix}"
    save_shard_file(path, idx)
    back = load_shard_file(path)
    assert back.dtype == np.int64 and np.array_equal(back, idx)
    assert not list(tmp_path.glob("*.tmp"))
    if suffix == ".json":
        assert json.loads(path.read_text())["indices"][:3] == idx[:3].tolist()


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"indices": [1, 2, 2]}', "unique"),
        ('{"indices": [1, -2]}', "non-negative"),
        ('{"indices": [1, 2.5]}', "integers"),
        ('{"indices": [true, 2]}', "integers"),
        ('{"indices": "1,2"}', "expected a JSON object"),
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_shard_file_rejects_bad_json(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_shard_file(p)


def test_shard_file_rejects_bad_npy(tmp_path):
    p = tmp_path / "f.npy"
    np.save(p, np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="integers"):
        load_shard_file(p)
    np.save(p, np.array([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="flat"):
        load_shard_file(p)
    np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a valid .npy"):
        load_shard_file(p)
    with pytest.raises(ValueError, match="not found"):
        load_shard_file(tmp_path / "missing.npy")
    with pytest.raises(ValueError, match="unique"):
        save_shard_file(tmp_path / "x.json", np.array([3, 3]))
