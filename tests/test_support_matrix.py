"""The README's support table, CI's lane list (.ci/lanes.txt) and the package metadata agree."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _ci_lanes():
    rows = []
    for line in _read(".ci", "lanes.txt").splitlines():
        if line.strip() and not line.startswith("#"):
            rows.append(tuple(line.split()))
    return rows


def _readme_lanes():
    text = _read("README.md")
    section = text.split("\n## Support matrix\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("lane", "---"):
            rows.append(tuple(cells[:4]))
    return rows


def test_readme_table_lists_exactly_the_ci_lanes():
    lanes = _ci_lanes()
    assert [lane[0] for lane in lanes] == ["main", "newest", "gpu-image", "floor"]
    assert _readme_lanes() == lanes


def test_ci_runs_every_lane_with_the_readme_test_command():
    run = _read(".ci", "run")
    assert ".ci/lanes.txt" in run and ".ci/lane.sh" in run
    command = re.search(r'^TEST_CMD="(.+)"$', run, re.M).group(1)
    assert f"\n{command}\n" in _read("README.md")


def test_lanes_span_the_promised_range():
    # setup.py's floor is the floor lane's torch; the matrix covers Python 3.10-3.12 and both
    # megatron-core releases the switch names.
    lanes = _ci_lanes()
    setup = _read("setup.py")
    floor = min(lanes, key=lambda lane: tuple(int(p) for p in lane[2].split(".")))
    assert f'"torch>={floor[2].rsplit(".0", 1)[0]}"' in setup, floor
    assert {lane[1] for lane in lanes} == {"3.10", "3.11", "3.12"}
    assert {lane[3] for lane in lanes} == {"0.16.1", "0.19.2"}
    assert 'python_requires=">=3.10"' in setup
