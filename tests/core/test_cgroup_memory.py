"""The memory a job may take under a cgroup limit: this process's own cgroup and every one above
it (a systemd slice or a job scheduler puts a process below the mount's root, where the limit
is not), cgroup v1 and v2, the inactive file cache counted as free (the kernel reclaims it
before it kills). Before, only the mount's root was read: a process limited below it was
estimated against the whole machine's memory and then killed half-way."""

from __future__ import annotations

from pathlib import Path

import pytest

from compress.memory import cgroup_headroom_bytes

GB = 10**9


def _write(root: Path, path: str, text: str) -> None:
    file = root / path.lstrip("/")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def _v2(root: Path, path: str, limit: str, usage: int, inactive: int = 0) -> None:
    folder = f"/sys/fs/cgroup{path}"
    _write(root, f"{folder}/memory.max", limit + "\n")
    _write(root, f"{folder}/memory.current", f"{usage}\n")
    _write(root, f"{folder}/memory.stat", f"anon {usage}\ninactive_file {inactive}\n")


def _v1(root: Path, path: str, limit: int, usage: int, inactive: int = 0) -> None:
    folder = f"/sys/fs/cgroup/memory{path}"
    _write(root, f"{folder}/memory.limit_in_bytes", f"{limit}\n")
    _write(root, f"{folder}/memory.usage_in_bytes", f"{usage}\n")
    _write(root, f"{folder}/memory.stat", f"cache {inactive}\ntotal_inactive_file {inactive}\n")


def test_v2_reads_the_process_own_cgroup_and_its_ancestors(tmp_path):
    _write(tmp_path, "/proc/self/cgroup", "0::/user.slice/job-7.scope\n")
    _v2(tmp_path, "", "max", 30 * GB)
    _v2(tmp_path, "/user.slice", str(20 * GB), 5 * GB)  # 15 GB left in the slice
    _v2(tmp_path, "/user.slice/job-7.scope", str(8 * GB), 3 * GB, inactive=1 * GB)
    assert cgroup_headroom_bytes(str(tmp_path)) == 8 * GB - 2 * GB
    _v2(tmp_path, "/user.slice", str(6 * GB), 5 * GB)  # the slice binds first
    assert cgroup_headroom_bytes(str(tmp_path)) == 1 * GB


def test_v1_memory_controller_line_among_others(tmp_path):
    _write(tmp_path, "/proc/self/cgroup",
           "9:name=systemd:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/other\n")
    _v1(tmp_path, "", 1 << 62, 12 * GB)  # the root: no limit ("9223372036854771712")
    _v1(tmp_path, "/process_api", 1 << 62, 12 * GB)
    _v1(tmp_path, "/process_api/abc", 4 * GB, 3 * GB, inactive=2 * GB)
    assert cgroup_headroom_bytes(str(tmp_path)) == 3 * GB


@pytest.mark.parametrize("cgroup", ["0::/\n", "4:memory:/\n", ""])
def test_no_limit_anywhere_is_none(cgroup, tmp_path):
    if cgroup:
        _write(tmp_path, "/proc/self/cgroup", cgroup)
    _v2(tmp_path, "", "max", 3 * GB)
    _v1(tmp_path, "", 1 << 62, 3 * GB)
    assert cgroup_headroom_bytes(str(tmp_path)) is None


def test_a_container_sees_its_limit_at_the_mount_root(tmp_path):
    # a container's namespace shows its own cgroup as "/" (no /proc/self/cgroup path below it)
    _write(tmp_path, "/proc/self/cgroup", "0::/\n")
    _v2(tmp_path, "", str(16 * GB), 10 * GB)
    assert cgroup_headroom_bytes(str(tmp_path)) == 6 * GB
    _v2(tmp_path, "", str(16 * GB), 20 * GB)  # at the limit (usage can pass it by the cache)
    assert cgroup_headroom_bytes(str(tmp_path)) == 0
