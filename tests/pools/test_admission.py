"""Admission rules that need no replicas: class ceilings, deadlines, tenant budgets."""

from __future__ import annotations

import pytest

from ember.domain.spec import Priority
from ember.errors import BackPressure
from ember.serving.admission import Admission


def test_background_classes_fill_their_share_of_the_queue() -> None:
    """One replica, batch 4, queue of 4 batches (16 units): batch work may keep 8 units
    in flight (a batch computing and one waiting), async 9.6, online all 16."""
    admission = Admission(units_per_s=1000, burst_units=1000)
    admission.admit("t", 4, Priority.batch, 4, 4, 100, 30, queue_units=16)  # 8 <= 8
    with pytest.raises(BackPressure, match="held back"):
        admission.admit("t", 4, Priority.batch, 8, 4, 100, 30, queue_units=16)
    admission.admit("t", 4, Priority.async_, 4, 4, 100, 30, queue_units=16)  # 8 <= 9.6
    admission.admit("t", 4, Priority.online, 12, 4, 100, 30, queue_units=16)


def test_an_idle_pool_takes_one_async_request_even_when_tiny() -> None:
    admission = Admission(units_per_s=1000, burst_units=1000)
    # one replica, max_batch_size 1: capacity 1 unit, async ceiling 0.7
    admission.admit("t", 1, Priority.async_, 0, 1, 10, 30)
    with pytest.raises(BackPressure, match="held back"):
        admission.admit("t", 1, Priority.async_, 1, 1, 10, 30)  # busy: online goes first
    admission.admit("t", 1, Priority.online, 1, 1, 10, 30)


def test_async_and_batch_stop_at_their_share_of_capacity() -> None:
    admission = Admission(units_per_s=1000, burst_units=1000)
    admission.admit("t", 1, Priority.async_, 5, 10, 10, 30)  # 6 <= 7
    with pytest.raises(BackPressure):
        admission.admit("t", 1, Priority.async_, 7, 10, 10, 30)  # 8 > 7
    with pytest.raises(BackPressure):
        admission.admit("t", 1, Priority.batch, 5, 10, 10, 30)  # 6 > 5


def test_a_predicted_wait_past_the_deadline_is_refused_now() -> None:
    admission = Admission(units_per_s=1000, burst_units=1000)
    with pytest.raises(BackPressure, match="predicted wait") as refused:
        admission.admit("t", 1, Priority.online, 30, 10, 10, 1.0)  # 20 units over: 2 s
    assert refused.value.retry_after_s >= 2.0


def test_a_flooding_tenant_spends_only_its_own_budget() -> None:
    admission = Admission(units_per_s=1, burst_units=5)
    for _ in range(5):
        admission.admit("flood", 1, Priority.online, 0, 100, 100, 30)
    with pytest.raises(BackPressure, match="flood"):
        admission.admit("flood", 1, Priority.online, 0, 100, 100, 30)
    admission.admit("quiet", 1, Priority.online, 0, 100, 100, 30)
