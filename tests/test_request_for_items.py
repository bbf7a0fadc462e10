"""``Request.for_items``: the requests of one call's items, built slot by slot, are
the requests ``Request(...)`` builds."""

from __future__ import annotations

import math

import attrs
import pytest
from trioserve import Request
from trioserve._messages import _FIELDS, Reply, ReplyGroup


def test_it_sets_every_field_of_request():
    # a field added to Request and not to for_items would be left unset
    assert _FIELDS == tuple(f.name for f in attrs.fields(Request))


@pytest.mark.parametrize(
    ("deadline", "answer_expiry"), [(math.inf, False), (12.5, True)]
)
def test_each_request_is_the_one_the_constructor_builds(deadline, answer_expiry):
    items = [{"x": i} for i in range(3)]
    prepared = [(item, cost) for item, cost in zip(items, (1, 4, 2), strict=True)]
    replies = ReplyGroup(3).replies
    shared = dict(
        model="m", tenant="t", priority="batch", arrival=2.0, deadline=deadline,
        answer_expiry=answer_expiry,
    )
    built = Request.for_items(prepared, replies, **shared)
    assert [type(r) for r in built] == [Request] * 3
    for r, (item, cost), reply in zip(built, prepared, replies, strict=True):
        expected = Request(item=item, cost=cost, reply=reply, **shared)
        for name in _FIELDS:
            assert getattr(r, name) is getattr(expected, name), name
        assert r == expected
        assert hash(r) == hash(expected)
        assert repr(r) == repr(expected)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            r.cost = 9  # type: ignore[misc]


def test_items_and_replies_must_pair_up_and_only_requests_are_built():
    shared = dict(
        model="m", tenant="t", priority="p", arrival=0.0, deadline=1.0, answer_expiry=True
    )
    with pytest.raises(ValueError, match="zip"):
        Request.for_items([(None, 1)] * 2, [Reply()], **shared)
    assert Request.for_items([], [], **shared) == []

    @attrs.frozen(kw_only=True, slots=True)
    class Other(Request):
        pass

    with pytest.raises(TypeError, match="builds Requests only"):
        Other.for_items([(None, 1)], [Reply()], **shared)
