"""Every answer breaks its time down (``Server-Timing``): the API process's whole time, the
gateway's parts, then the replica's, consistent with each other and with
``X-Ember-Replica-Ms``."""

from __future__ import annotations

import concurrent.futures

import httpx

from tests.gateway.conftest import Live, deploy

API_PARTS = ("api", "gateway", "admit", "hop")
REPLICA_PARTS = ("queue", "batch", "handoff", "forward", "replica")
ROUNDING_MS = 0.01  # each part is written with 3 decimals


def parts(response: httpx.Response) -> dict[str, float]:
    out = {}
    for entry in response.headers["server-timing"].split(","):
        name, _, dur = entry.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_answers_carry_their_time_by_segment(live: Live) -> None:
    live.register("mlp", "1")
    deploy(live, "mlp")
    ok = live.predict("mlp", 2)
    assert ok.status_code == 200, ok.text
    got = parts(ok)
    assert list(got) == [*API_PARTS, *REPLICA_PARTS]
    assert all(v >= 0 for v in got.values()), got
    assert got["replica"] == float(ok.headers["x-ember-replica-ms"])
    assert got["forward"] > 0
    # nested: the replica's parts within its time, its time within the hop, the hop and
    # what came before it within the gateway's, the gateway within the API process's
    inside = sum(got[k] for k in ("queue", "batch", "handoff", "forward"))
    assert inside <= got["replica"] + ROUNDING_MS
    assert got["replica"] <= got["hop"] + ROUNDING_MS
    assert got["admit"] + got["hop"] <= got["gateway"] + ROUNDING_MS
    assert got["gateway"] <= got["api"] + ROUNDING_MS


def test_a_request_behind_a_running_forward_pass_shows_it_as_queue(live: Live) -> None:
    live.register("slow", "1", slow_s=0.3)
    deploy(live, "slow", max_batch_size=1)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: live.predict("slow"), range(3)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    timings = [parts(a) for a in answers]
    # one forward pass at a time: at least one of three concurrent requests waited for an
    # earlier one's, and that wait is the queue, not the (already full) batch window
    waited = max(timings, key=lambda t: t["queue"])
    assert waited["queue"] > 0 and waited["queue"] > waited["batch"], timings
    for t in timings:
        assert t["queue"] + t["batch"] + t["forward"] <= t["replica"] + ROUNDING_MS
