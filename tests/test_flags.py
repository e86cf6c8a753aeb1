"""megatron_core.flags: every environment variable of the package is read there, in one way."""

import re
from pathlib import Path

import pytest

from megatron_core import flags
from megatron_core.errors import MegatronCoreError

ROOT = Path(__file__).resolve().parent.parent
# Set by the main job's launcher for the ranks it starts, never by a user.
LAUNCHER_HAND_OVER = {"RENDEZVOUS_ENV", "LAUNCHER_PID_ENV"}


@pytest.mark.parametrize("value, expected", [("1", True), (" Yes ", True), ("ON", True),
                                             ("0", False), ("off", False), ("No", False),
                                             ("", None)])  # fmt: skip
def test_flag_reads_yes_no_and_unset(value, expected, monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_SWITCH", value)
    assert flags.flag("MEGATRON_CORE_SWITCH") is expected
    monkeypatch.delenv("MEGATRON_CORE_SWITCH")
    assert flags.flag("MEGATRON_CORE_SWITCH") is None


def test_a_bad_value_raises_naming_variable_and_value(monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_SWITCH", "2")
    with pytest.raises(flags.FlagError, match=r"MEGATRON_CORE_SWITCH='2' is not one of 1/true"):
        flags.flag("MEGATRON_CORE_SWITCH")
    monkeypatch.setenv("MEGATRON_CORE_CHECK_CONSISTENCY", "Always")
    assert flags.flag("MEGATRON_CORE_CHECK_CONSISTENCY", also=("always",)) == "always"
    monkeypatch.setenv("MEGATRON_CORE_TEST_DEVICE", "tpu")
    with pytest.raises(MegatronCoreError, match="MEGATRON_CORE_TEST_DEVICE='tpu' is not one of"):
        flags.choice("MEGATRON_CORE_TEST_DEVICE", ("cpu", "cuda"))
    with pytest.raises(MegatronCoreError, match="not one of the package's variables"):
        flags.flag("MEGATRON_CORE_NO_SUCH_THING")


@pytest.mark.parametrize("value, kwargs, expected", [
    ("12", {"integer": True}, 12), ("2.5", {}, 2.5), ("off", {"off": True}, 0),
    ("none", {"off": True}, 0), ("-1", {}, "must be a number >= 0"),
    ("1.5", {"integer": True}, "must be an integer >= 0"), ("off", {}, "must be a number"),
    ("nan", {}, "must be a number"),
])  # fmt: skip
def test_number(value, kwargs, expected, monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_PEER_DEADLINE", value)
    if isinstance(expected, str):
        with pytest.raises(flags.FlagError, match=expected):
            flags.number("MEGATRON_CORE_PEER_DEADLINE", **kwargs)
    else:
        assert flags.number("MEGATRON_CORE_PEER_DEADLINE", **kwargs) == expected


def test_the_switch_flag_no_longer_reads_a_typo_as_off(monkeypatch):
    from megatron_core import megatron

    monkeypatch.setenv("MEGATRON_CORE_SWITCH", "2")
    with pytest.raises(flags.FlagError, match="MEGATRON_CORE_SWITCH='2'"):
        megatron.install_from_env()


def test_no_module_reads_a_package_variable_itself():
    """Outside flags.py no module reads os.environ / os.getenv with a MEGATRON_CORE_ name or a
    *_ENV constant (the launcher's hand-over variables excepted)."""
    reader = r"(os\.environ(\.get)?[\[(]|os\.getenv\()"
    pattern = re.compile(reader + r"\s*([A-Z_]+_ENV\b|\"MEGATRON_CORE_)")
    offenders = []
    for path in sorted((ROOT / "megatron_core").rglob("*.py")):
        if path.name == "flags.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = pattern.search(line)
            if match and match.group(3) not in LAUNCHER_HAND_OVER:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "read through megatron_core.flags instead:\n" + "\n".join(offenders)


def test_the_guide_lists_every_variable():
    guide = (ROOT / "docs" / "guides" / "environment-variables.md").read_text()
    listed = set(re.findall(r"^\| `(MEGATRON_CORE_[A-Z_]+)` \|", guide, re.M))
    assert listed == {v.name for v in flags.VARIABLES}
    used = set()
    for path in (ROOT / "megatron_core").rglob("*.py"):
        used |= set(re.findall(r"\"(MEGATRON_CORE_[A-Z_]+)\"", path.read_text()))
    hand_over = {"MEGATRON_CORE_RENDEZVOUS", "MEGATRON_CORE_LAUNCHER_PID"}
    assert used - hand_over == {v.name for v in flags.VARIABLES}
