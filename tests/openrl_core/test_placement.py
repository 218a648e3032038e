"""Placement policies: hand-built cases, then properties over generated inventories."""

from __future__ import annotations

import random

import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.placement import Device, Job, Placement, place

GiB = 1 << 30


def test_binpack_time_slices_two_jobs_on_one_device_that_holds_both():
    devices = [Device("a", 0, 10 * GiB), Device("a", 1, 10 * GiB)]
    jobs = [Job("trainer", 4 * GiB), Job("sampler", 5 * GiB)]
    assert place(jobs, devices, "binpack").assignments == {"trainer": "a/0", "sampler": "a/0"}
    assert place(jobs, devices, "spread").assignments == {"sampler": "a/0", "trainer": "a/1"}


def test_a_job_that_fits_nowhere_is_unplaced_with_the_reason():
    devices = [Device("a", 0, 10 * GiB, reserved_bytes=3 * GiB)]
    result = place([Job("big", 8 * GiB)], devices, "binpack")
    assert result.assignments == {}
    assert result.unplaced == {"big": f"needs {8 * GiB} bytes; the most any accelerator has free is {7 * GiB}"}
    assert place([Job("x", 1)], [], "spread").unplaced == {"x": "no accelerators in the inventory"}


def test_reserved_bytes_of_foreign_residents_count_against_the_budget():
    devices = [Device("a", 0, 10 * GiB, reserved_bytes=6 * GiB), Device("b", 0, 10 * GiB)]
    result = place([Job("j", 5 * GiB)], devices, "binpack")
    assert result.assignments == {"j": "b/0"}


def test_an_exclusive_job_shares_with_nobody():
    devices = [Device("a", 0, 80 * GiB), Device("a", 1, 80 * GiB)]
    jobs = [Job("full", 30 * GiB, exclusive=True), Job("lora-1", 4 * GiB), Job("lora-2", 4 * GiB)]
    result = place(jobs, devices, "binpack")
    assert result.jobs_on(result.assignments["full"]) == ["full"]
    assert result.assignments["lora-1"] == result.assignments["lora-2"] != result.assignments["full"]
    crowded = place([Job("full", 1, exclusive=True), Job("other", 1)], [Device("a", 0, 10)], "binpack")
    assert list(crowded.assignments) == ["full"] and "exclusive" not in crowded.unplaced["other"]
    assert "exclusive" in place([Job("x", 1, True), Job("y", 2)], [Device("a", 0, 10)], "binpack").unplaced["x"]


def test_pinned_jobs_keep_their_device_and_move_only_when_it_is_gone():
    devices = [Device("a", 0, 10 * GiB), Device("b", 0, 10 * GiB)]
    jobs = [Job("t", 4 * GiB), Job("s", 4 * GiB)]
    # spread would give each its own device; the running ones stay where they are instead
    assert place(jobs, devices, "spread", pinned={"t": "b/0", "s": "b/0"}).assignments == {"t": "b/0", "s": "b/0"}
    moved = place(jobs, [Device("a", 0, 10 * GiB)], "binpack", pinned={"t": "b/0", "s": "a/0"})
    assert moved.assignments == {"s": "a/0", "t": "a/0"}


def test_binpack_falls_back_to_compacting_spread_when_its_greedy_pass_strands_a_job():
    # Greedy best fit puts 7 on the 8-byte device, 4+4 on the 9-byte one and strands the 2;
    # spread places all four. Binpack then packs spread's assignment: all four, two devices.
    devices = [Device("n", 0, 8), Device("n", 1, 9)]
    jobs = [Job("j0", 7), Job("j1", 4), Job("j2", 2), Job("j3", 4)]
    result = place(jobs, devices, "binpack")
    assert not result.unplaced and len(result.assignments) == 4 and result.devices_used() == 2
    _assert_within_budgets(result, jobs, devices)


def test_bad_inputs_are_refused_with_typed_errors():
    with pytest.raises(InvalidRequest, match="unknown placement policy 'tetris'"):
        place([], [], "tetris")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="unique"):
        place([Job("a", 1), Job("a", 2)], [], "spread")
    with pytest.raises(InvalidRequest, match="positive"):
        place([Job("a", 0)], [], "spread")
    with pytest.raises(InvalidRequest, match="unique"):
        place([], [Device("n", 0, 1), Device("n", 0, 2)], "spread")


def _assert_within_budgets(result: Placement, jobs: list[Job], devices: list[Device]) -> None:
    by_name = {job.name: job for job in jobs}
    assert set(result.assignments) | set(result.unplaced) == set(by_name)
    assert not set(result.assignments) & set(result.unplaced)
    for device in devices:
        on = [by_name[name] for name in result.jobs_on(device.id)]
        assert device.reserved_bytes + sum(job.memory_bytes for job in on) <= device.budget_bytes
        if any(job.exclusive for job in on):
            assert len(on) == 1
    assert set(result.assignments.values()) <= {device.id for device in devices}


def _inventory(seed: int) -> tuple[list[Job], list[Device]]:
    rng = random.Random(seed)
    devices = [
        Device(f"node-{n}", i, rng.choice([4, 8, 16, 24, 40, 80]) * GiB, rng.choice([0, 0, 0, 1, 2]) * GiB)
        for n in range(rng.randint(0, 4))
        for i in range(rng.randint(1, 4))
    ]
    jobs = [Job(f"job-{k}", rng.randint(1, 60) * GiB // 2, rng.random() < 0.15) for k in range(rng.randint(0, 14))]
    return jobs, devices


SEEDS = range(3000)


def test_generated_inventories_never_go_over_a_budget():
    for seed in SEEDS:
        jobs, devices = _inventory(seed)
        for policy in ("binpack", "spread"):
            _assert_within_budgets(place(jobs, devices, policy), jobs, devices)


def test_binpack_never_uses_more_devices_nor_places_fewer_jobs_than_spread():
    fewer_devices = 0
    for seed in SEEDS:
        jobs, devices = _inventory(seed)
        packed, spread = place(jobs, devices, "binpack"), place(jobs, devices, "spread")
        assert packed.devices_used() <= spread.devices_used(), seed
        assert len(packed.assignments) >= len(spread.assignments), seed
        fewer_devices += packed.devices_used() < spread.devices_used()
    assert fewer_devices > len(SEEDS) // 4  # the property is not vacuous: binpack often saves devices


def test_placement_is_deterministic_whatever_the_input_order():
    for seed in range(500):
        jobs, devices = _inventory(seed)
        rng = random.Random(seed)
        for policy in ("binpack", "spread"):
            first = place(jobs, devices, policy)
            shuffled_jobs, shuffled_devices = jobs[:], devices[:]
            rng.shuffle(shuffled_jobs)
            rng.shuffle(shuffled_devices)
            again = place(shuffled_jobs, shuffled_devices, policy)
            assert (dict(again.assignments), dict(again.unplaced)) == (dict(first.assignments), dict(first.unplaced))


def test_running_jobs_stay_put_when_the_inventory_is_unchanged():
    for seed in range(500):
        jobs, devices = _inventory(seed)
        first = place(jobs, devices, "binpack")
        extra = Job("newcomer", GiB)
        again = place([*jobs, extra], devices, "spread", pinned=first.assignments)
        assert {name: again.assignments[name] for name in first.assignments} == dict(first.assignments)
