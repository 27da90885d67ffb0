"""psctl mpi's placement: roles from every rank's host and GPUs, one worker per GPU (no MPI, no GPU needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgrid.cluster.mpi.placement import COORDINATOR, SERVER, WORKER, PlacementError, place


def cluster(*nodes: tuple[int, int]) -> tuple[list[str], list[list[str]]]:
    """Hosts and GPU lists, by rank, for nodes given as (ranks, GPUs), ranks in block order as srun gives them."""
    hosts, gpus = [], []
    for n, (ranks, count) in enumerate(nodes):
        hosts += [f"gpu{n:02d}"] * ranks
        gpus += [[f"0000:{n:02x}:{i:02x}.0" for i in range(count)]] * ranks
    return hosts, gpus


def block(ranks: int, nodes: int, gpus_per_node: int) -> tuple[list[str], list[list[str]]]:
    """What ``srun -N nodes -n ranks --gpus-per-node=G`` gives: ranks spread in blocks, the odd ones first."""
    return cluster(*[(ranks // nodes + (n < ranks % nodes), gpus_per_node) for n in range(nodes)])


def kinds(p) -> list[str]:
    return [r.kind[0] for r in p.roles]  # c, s, w: a layout at a glance


def physical(p, gpus, rank) -> str:
    return gpus[rank][p.roles[rank].gpu]


def check(p, hosts, gpus, shards, *, shared=False) -> None:
    """What every placement holds: the roles add up, and no two workers share a GPU unless asked."""
    size = len(hosts)
    assert p.roles[0].kind == COORDINATOR
    assert sorted(p.roles[r].index for r in p.ranks(SERVER)) == list(range(shards))
    workers = p.ranks(WORKER)
    assert sorted(p.roles[r].index for r in workers) == list(range(size - 1 - shards))
    for node in range(len(p.hosts)):
        here = [r for r in workers if p.roles[r].node == node]
        assert sorted(p.roles[r].local_rank for r in here) == list(range(len(here)))
        assert all(hosts[r] == p.hosts[node] for r in here)
    if p.gpus:
        used = [(hosts[r], physical(p, gpus, r)) for r in workers]
        assert shared or len(set(used)) == len(used), "two workers on one GPU"


def test_a_cpu_job_takes_roles_by_rank_on_any_layout():
    hosts = ["a", "a", "b", "b", "b", "a"]
    p = place(hosts, [[]] * 6, 2)
    assert kinds(p) == ["c", "s", "s", "w", "w", "w"]
    assert [r.index for r in p.roles] == [0, 0, 1, 0, 1, 2]
    assert [r.local_rank for r in p.roles[3:]] == [0, 1, 0]  # workers 0, 1 on b; worker 2 on a
    assert (p.hosts, p.gpus, p.notes) == (("a", "b"), 0, ())
    # device = cpu ignores GPUs: one node's GPUs never turn a CPU job away
    hosts, gpus = cluster((6, 1))
    assert kinds(place(hosts, gpus, 1, device="cpu")) == ["c", "s", "w", "w", "w", "w"]


def test_one_node_gives_worker_i_gpu_i():
    hosts, gpus = cluster((6, 4))
    p = place(hosts, gpus, 1)
    assert kinds(p) == ["c", "s", "w", "w", "w", "w"]  # the same roles as by rank
    assert [(r.local_rank, r.gpu) for r in p.roles[2:]] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert (p.gpus, p.notes) == (4, ())


def test_two_nodes_each_map_their_workers_onto_their_gpus():
    # srun -N 2 --ntasks-per-node=5 --gpus-per-node=4 --shards 1: by rank, node 1 had 5 workers for 4 GPUs
    hosts, gpus = cluster((5, 4), (5, 4))
    p = place(hosts, gpus, 1)
    check(p, hosts, gpus, 1)
    assert kinds(p) == ["c", "w", "w", "w", "w", "s", "w", "w", "w", "w"]
    assert [p.workers_on(n) for n in (0, 1)] == [4, 4]
    assert [p.roles[r].gpu for r in p.ranks(WORKER)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert p.notes == ()
    # srun -N 2 -n 11 --gpus-per-node=4 --shards 2: one shard on each node
    hosts, gpus = block(11, 2, 4)
    p = place(hosts, gpus, 2)
    check(p, hosts, gpus, 2)
    assert kinds(p) == ["c", "s", "w", "w", "w", "w", "s", "w", "w", "w", "w"]


def test_more_workers_than_gpus_fails_naming_the_numbers_that_fit():
    hosts, gpus = cluster((6, 4), (6, 4))  # srun -N 2 --ntasks-per-node=6 --gpus-per-node=4 --shards 2
    with pytest.raises(PlacementError) as e:
        place(hosts, gpus, 2)
    assert str(e.value) == (
        "12 ranks leave 9 workers beside the coordinator and 2 shards, for 8 GPUs on 2 nodes; run 11 ranks "
        "(srun -N 2 -n 11 --gpus-per-node=4), or keep 12 ranks with --shards 3 for one worker per GPU, "
        "or let workers share GPUs with --oversubscribe"
    )
    # both fixes are layouts that place one worker per GPU, every GPU busy
    for (h, g), shards in [(block(11, 2, 4), 2), ((hosts, gpus), 3)]:
        p = place(h, g, shards)
        check(p, h, g, shards)
        assert (len(p.ranks(WORKER)), p.notes) == (8, ())


def test_a_first_node_without_room_for_the_coordinator_fails():
    hosts, gpus = cluster((4, 4), (7, 4))  # 11 ranks, but the coordinator takes one of node 0's four
    with pytest.raises(
        PlacementError,
        match=r"^8 workers do not fit one per GPU: gpu00 has 3 ranks besides the "
        r"coordinator for 4 GPUs; run 11 ranks \(srun -N 2 -n 11 "
        r"--gpus-per-node=4\), or keep 11 ranks with --shards 3 ",
    ):
        place(hosts, gpus, 2)


def test_one_node_with_too_many_ranks_names_mpiexec_numbers():
    hosts, gpus = cluster((6, 1))
    with pytest.raises(
        PlacementError,
        match=r"^6 ranks leave 4 workers beside the coordinator and 1 shard, "
        r"for 1 GPU on 1 node; run 3 ranks \(-n 3\), or keep 6 ranks "
        r"with --shards 4 ",
    ):
        place(hosts, gpus, 1)


def test_oversubscribe_shares_gpus_evenly_and_says_so():
    hosts, gpus = cluster((6, 2))
    p = place(hosts, gpus, 1, oversubscribe=True)
    check(p, hosts, gpus, 1, shared=True)
    assert [p.roles[r].gpu for r in p.ranks(WORKER)] == [0, 1, 0, 1]
    assert p.notes == ("4 workers share 2 GPUs (--oversubscribe)",)


def test_idle_gpus_are_a_note_not_an_error():
    hosts, gpus = cluster((5, 4), (5, 4))  # the README's old example: 10 ranks, 2 shards, 8 GPUs
    p = place(hosts, gpus, 2)
    check(p, hosts, gpus, 2)
    assert [p.workers_on(n) for n in (0, 1)] == [4, 3]
    assert p.notes == (
        "1 of the 8 GPUs idle: 10 ranks leave 7 workers beside the coordinator and 2 shards; "
        "11 ranks (srun -N 2 -n 11 --gpus-per-node=4) give every GPU a worker",
    )


def test_ranks_that_see_one_gpu_each_use_device_0():
    # srun --gpus-per-task=1 with device cgroups: each rank sees only its own GPU, as device 0
    hosts = ["a"] * 5
    gpus = [["0000:01:00.0"], ["0000:02:00.0"], ["0000:03:00.0"], ["0000:04:00.0"], ["0000:05:00.0"]]
    p = place(hosts, gpus, 1)
    check(p, hosts, gpus, 1)
    assert kinds(p) == ["c", "s", "w", "w", "w"]
    assert [p.roles[r].gpu for r in p.ranks(WORKER)] == [0, 0, 0]
    # the same GPU seen by two ranks is one GPU: one of them serves the shard instead
    gpus[3] = gpus[4]
    p = place(hosts, gpus, 1)
    check(p, hosts, gpus, 1)
    assert kinds(p) == ["c", "w", "w", "s", "w"]
    # and seen by three, 3 workers cannot have one each
    gpus[2] = gpus[4]
    with pytest.raises(PlacementError, match="^3 workers do not fit one per GPU"):
        place(hosts, gpus, 1)


def test_a_node_without_gpus_serves_shards_only():
    hosts, gpus = cluster((3, 0), (4, 4))
    p = place(hosts, gpus, 2)
    check(p, hosts, gpus, 2)
    assert kinds(p) == ["c", "s", "s", "w", "w", "w", "w"]
    assert [p.workers_on(n) for n in (0, 1)] == [0, 4]


def test_device_gpu_without_gpus_fails_naming_the_fix():
    with pytest.raises(PlacementError, match="no rank sees a CUDA GPU: install psgrid\\[gpu\\].*--device cpu"):
        place(["a"] * 4, [[]] * 4, 1, device="gpu")


def test_bad_arguments_are_programming_errors():
    with pytest.raises(ValueError):
        place(["a"] * 2, [[]] * 2, 1)
    with pytest.raises(ValueError):
        place(["a"] * 3, [[]] * 2, 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 7), st.integers(0, 5)), min_size=1, max_size=4), st.integers(1, 3), st.booleans()
)
def test_placement_fails_exactly_when_no_one_per_gpu_layout_exists(nodes, shards, oversubscribe):
    hosts, gpus = cluster(*nodes)
    if len(hosts) < shards + 2:
        return
    workers = len(hosts) - 1 - shards
    # a node can give as many workers a GPU each as it has GPUs and ranks; node 0's rank 0 coordinates
    room = sum(min(ranks - (n == 0), count) for n, (ranks, count) in enumerate(nodes))
    total = sum(count for _, count in nodes)
    try:
        p = place(hosts, gpus, shards, oversubscribe=oversubscribe)
    except PlacementError:
        assert total and room < workers
        if oversubscribe:  # sharing fails only when too few ranks see a GPU at all
            assert sum(ranks - (n == 0) for n, (ranks, count) in enumerate(nodes) if count) < workers
        return
    check(p, hosts, gpus, shards, shared=oversubscribe)
    assert not total or room >= workers or oversubscribe
