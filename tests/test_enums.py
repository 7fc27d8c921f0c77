"""accelerate_c's enums print, format, compare, hash and answer `in` as accelerate 1.15's own,
member by member (a log line or an `if str(acc.distributed_type) == ...` reads the same)."""
from __future__ import annotations

import warnings

import pytest

from accelerate_c.utils import dataclasses as ours

NAMES = ["DistributedType", "PrecisionType", "DynamoBackend", "RNGType", "DDPCommunicationHookType"]


def _behaviour(member):
    """Everything a user's code can observe of one member, as comparable values."""
    cls = type(member)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.11's Enum.__contains__ on a str
        try:
            contains = (member.value in cls, "not-a-member" in cls)
        except TypeError:
            contains = "TypeError"
    return {
        "name": member.name, "value": member.value, "repr": repr(member), "str": str(member),
        "format": format(member), "f-spec": f"{member:>20}", "percent": "%s" % member,
        "eq value": member == member.value, "ne value": member != member.value,
        "hash as value": hash(member) == hash(member.value), "is str": isinstance(member, str),
        "by value": cls(member.value) is member, "contains": contains,
        "list": cls.list() if hasattr(cls, "list") else None,
    }


@pytest.mark.parametrize("name", NAMES)
def test_enum_matches_accelerate_member_by_member(name):
    theirs_mod = pytest.importorskip("accelerate.utils.dataclasses")
    mine, theirs = getattr(ours, name), getattr(theirs_mod, name)
    assert [m.name for m in mine] == [m.name for m in theirs]
    for m in theirs:
        assert _behaviour(mine[m.name]) == _behaviour(m), m.name


def test_str_of_distributed_type_names_the_member():
    # accelerate prints the member ('DistributedType.NO'), yet it is equal to the plain value
    assert str(ours.DistributedType.NO) == "DistributedType.NO"
    assert ours.DistributedType.MULTI_CPU == "MULTI_CPU"
    assert str(ours.PrecisionType.BF16) == "bf16"


def test_exported_from_accelerate_c_utils():
    import accelerate_c.utils as u

    for name in NAMES:
        assert getattr(u, name) is getattr(ours, name)
