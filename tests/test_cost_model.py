"""The cost model across hosts (benchmarks/cost_model.py): bytes per link and the step with the wire overlapping."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_model.py"
_spec = importlib.util.spec_from_file_location("cost_model", _PATH)
cost_model = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cost_model", cost_model)  # its dataclasses look their module up there
_spec.loader.exec_module(cost_model)

GBIT = 10**9
PARAMS = 1_000_000  # 4 MB a copy
# 2 hosts, a shard on each, 2 workers on each: every worker pulls and pushes the other host's half
SHARDS, WORKERS = [0, 1], [0, 0, 1, 1]


def test_the_busiest_link_carries_the_other_hosts_halves_and_aggregation_divides_them():
    assert cost_model.busiest_link_bytes(PARAMS, SHARDS, WORKERS) == (2 * 2 * PARAMS, 2 * 2 * PARAMS)
    assert cost_model.busiest_link_bytes(PARAMS, SHARDS, WORKERS, aggregate=True) == (2 * PARAMS, 2 * PARAMS)


def test_the_wire_replaces_the_unshaped_transfer_where_it_is_longer():
    share = 0.8
    wire = 2 * 4 * PARAMS / (GBIT / 8 * share)  # the pull's bytes and the push's, 64 ms
    p = cost_model.links_step_s(PARAMS, SHARDS, WORKERS, GBIT, 0.050, base_transfer_s=0.020, share=share)
    assert p["wire_s"] == pytest.approx(wire)
    assert p["step_s"] == pytest.approx(0.050 - 0.020 + wire)  # not 0.050 + wire: the copies overlap it


def test_a_transfer_longer_than_the_wire_leaves_the_unshaped_step():
    p = cost_model.links_step_s(PARAMS, SHARDS, WORKERS, 100 * GBIT, 0.050, base_transfer_s=0.020)
    assert p["wire_s"] < 0.020
    assert p["step_s"] == pytest.approx(0.050)


def test_the_share_defaults_to_one_streams_and_a_measured_one_slows_the_wire():
    one_stream = cost_model.links_step_s(PARAMS, SHARDS, WORKERS, GBIT, 0.0)
    assert one_stream["share"] == cost_model.TBF_PAYLOAD_SHARE
    mesh = cost_model.links_step_s(PARAMS, SHARDS, WORKERS, GBIT, 0.0, share=cost_model.TBF_PAYLOAD_SHARE / 2)
    assert mesh["wire_s"] == pytest.approx(2 * one_stream["wire_s"])


def test_with_the_pull_ahead_an_async_step_is_the_longest_of_compute_pull_and_push():
    host = cost_model.Host(pcie_h2d=50.0, pcie_d2h=50.0, update_gbps={4: 40.0}, check_factor={4: 1.0})
    plain = cost_model.step_s(20_000_000, 1, 1, "async", 0.003, host)
    ahead = cost_model.step_s(20_000_000, 1, 1, "async", 0.003, host, pull_ahead=True)
    assert ahead["step_s"] == pytest.approx(
        max(0.003 + ahead["d2h_s"], ahead["pull_s"], ahead["push_s"]) + cost_model.RTT_S
    )
    assert ahead["step_s"] < plain["step_s"]
    sync = cost_model.step_s(20_000_000, 1, 1, "sync", 0.003, host, pull_ahead=True)
    assert sync == cost_model.step_s(20_000_000, 1, 1, "sync", 0.003, host)  # sync has none


def test_a_device_shards_sync_step_adds_its_calls_and_an_async_one_overlaps_them():
    DeviceLink, device_step_s = cost_model.DeviceLink, cost_model.device_step_s
    link = DeviceLink(copy_gbps=2400, push_fixed_s=6e-4, pull_fixed_s=1e-4, switch_s=3e-4)
    sync = device_step_s(20_000_000, "sync", 2.7e-3, link)
    assert sync["step_s"] == pytest.approx(sync["pull_s"] + 2.7e-3 + sync["push_s"])
    assert sync["push_s"] > link.push_fixed_s + sync["update_s"]  # the slot's copy too
    overlapped = device_step_s(20_000_000, "async", 2.7e-3, link)
    assert overlapped["step_s"] < sync["step_s"]
    assert overlapped["step_s"] >= overlapped["pull_s"] + 2.7e-3 + overlapped["update_s"]  # the GPU is shared
    assert device_step_s(20_000_000, "async", 2.7e-3, link, overlap=False)["step_s"] == pytest.approx(sync["step_s"])
    # Adam reads and writes two more state arrays: a longer update
    assert device_step_s(20_000_000, "sync", 2.7e-3, link, optimizer="adam")["update_s"] > sync["update_s"]
