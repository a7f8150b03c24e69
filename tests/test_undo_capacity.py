"""What an undo does with the capacity it has: on the fake API server (tests/k8s_fake.py).

Wrong answers take the new release out of the route at once, whatever the old side holds: the
record says how far over its servers then run, and they come back in the widest wave the budget
leaves once the new release gave its servers back (not one `spare_servers` wave at a time).
(An SLO failure moves traffic back only as the old side's Ready servers hold it, asserted at every
change of the route or of Ready pods: test_k8s_deploy's failed-analysis test, at every step.)
"""

from __future__ import annotations

import copy

from pipeline.core.rollout import ServerStep
from pipeline.k8s.deploy import KubernetesTarget
from pipeline.release import controller
from tests.test_k8s_deploy import FAST, SERVICE, deploy, fake, live, releases, served, verdict  # noqa: F401

# a 3-server fleet, spare 1: the second step leaves the old release one server beside three new ones
STEPS = [
    ServerStep(fraction=0.1, old_servers=3, new_servers=1),
    ServerStep(fraction=0.67, old_servers=1, new_servers=3),
    ServerStep(fraction=1.0, old_servers=0, new_servers=3),
]


def test_wrong_answers_leave_at_once_and_the_old_side_reloads_in_the_widest_wave(fake, releases):  # noqa: F811
    live(fake, releases["1"], "1")
    outcome = deploy(
        KubernetesTarget(fake.client(), **FAST),
        "2",
        copy.deepcopy(releases["2"]),
        STEPS,
        lambda s, f, pods: verdict(s, f),
        timeout_s=5,
        answers=lambda step, endpoint, model: served(step, passed=step < 3),
    )
    assert outcome.status == "rolled_back", outcome.error
    events = dict(outcome.events)
    # at the last step's check one old server ran beside three new: all traffic to it at once, three
    # servers' load on one, on record
    assert events["rollback_started"]["overload"] == {"servers": 1, "load_of_servers": 3, "factor": 3.0}
    r1, r2 = SERVICE
    started = [k for k, _ in outcome.events].index("rollback_started")
    back = [d["weights"] for k, d in outcome.events[started:] if k == "traffic"]
    assert back[0] == {r1: 10_000, r2: 0}
    # the new release gave back its three servers, so the old one's two missing came back in one
    # wave (one spare server's wave each before): never more than live + spare at once
    aborted = next(i for i, h in enumerate(fake.history) if h.get("2") == 0)
    assert [h["1"] for h in fake.history[aborted:]] == [1, 3], fake.history
    assert all(sum(h.values()) <= 4 for h in fake.history), fake.history
    assert fake.servers() == {"1": 3, "2": 0}


def test_the_widest_reload_wave_counts_what_still_terminates():
    # live 3 + spare 1; one old server runs: with the new release's 3 servers still there, none fits
    assert controller.reload_wave(3, 1, 3, 1) == 0
    # the new release scaled to zero and its pods gone: both missing old servers in one wave
    assert controller.reload_wave(3, 1, 0, 1) == 2
    # scaled to zero but two of its pods still drain (holding their GPUs): one fits
    assert controller.reload_wave(3, 1, 0, 1, terminating=2) == 1
    # never more than the live fleet
    assert controller.reload_wave(3, 2, 0, 5) == 1
