"""The ballot rules of the commit protocol (averaging/ballots.py), one at a time.

The protocol as a whole, under kills, stops and cut links, is tested on a
simulated network in test_averaging_allreduce.py.
"""

from __future__ import annotations

from shoal.averaging.ballots import Ballots, Decision, quorums

COMMIT_0 = Decision(0, True, "", frozenset())


def abort(ballot: int) -> Decision:
    return Decision(ballot, False, "stalled", frozenset({0}))


def test_a_proposal_is_accepted_only_from_its_ballots_owner_and_not_below_a_promise() -> None:
    b = Ballots(4, 2, 0.0)
    assert not b.accept(1, COMMIT_0, 1.0)  # member 1 relaying member 0's proposal
    assert b.accept(0, COMMIT_0, 1.0) and b.accepted == COMMIT_0
    assert b.promise(5, 2.0)  # member 1's takeover
    assert not b.accept(0, COMMIT_0, 3.0)  # too late for ballot 0
    later = Ballots(4, 2, 0.0)
    later.promise(5, 0.0)
    assert not later.accept(0, COMMIT_0, 1.0) and later.accepted is None


def test_accepting_a_higher_ballot_promises_it_and_ends_our_own_takeover() -> None:
    b = Ballots(4, 2, 0.0)
    assert b.lead({0, 1, 3}, 0.0) == 2
    assert b.accept(3, abort(3), 1.0)
    assert b.promised == 3 and b.takeover is None and b.deferring(set())
    assert not b.deferring({3})  # its owner is suspected: nothing to wait for


def test_a_proposal_is_chosen_once_every_member_waited_for_accepted_or_was_given_up() -> None:
    b = Ballots(4, 0, 0.0)
    b.propose(COMMIT_0, {1, 2, 3})
    assert b.accepted == COMMIT_0 and b.chosen() is None
    b.heard(1, 0, None, COMMIT_0)
    b.heard(2, 0, COMMIT_0, None)  # it learned the decision from someone: counts too
    b.heard(3, 6, None, None)  # it promised a higher ballot: it will not accept
    assert b.chosen() is None
    b.give_up_on(3)
    assert b.chosen() == (COMMIT_0, 3)  # accepted by three of four: the proposer, 1 and 2


def test_quorums_of_a_takeover_and_of_a_decision_always_share_a_member() -> None:
    assert [quorums(n) for n in range(1, 7)] == [(1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3)]
    for n in range(1, 50):
        prepare, accept = quorums(n)
        assert prepare + accept == n + 1 and prepare > n / 2


def test_a_member_that_has_not_started_the_round_counts_for_an_abort_never_a_commit() -> None:
    commit, abort_ = Ballots(3, 0, 0.0), Ballots(3, 1, 0.0)
    commit.propose(COMMIT_0, {1, 2})
    assert not commit.not_started(2, "accept")
    abort_.propose(abort(4), {0, 2})
    assert abort_.not_started(2, "accept") and abort_.proposal.waiting == {0}


def test_a_takeover_ends_with_the_highest_ballot_reported_decided_or_accepted() -> None:
    b = Ballots(4, 2, 0.0)
    ballot = b.lead({1, 3}, 0.0)
    assert ballot == 2 and b.takeover_value() is None  # answers missing
    b.heard(1, ballot, None, COMMIT_0)
    assert b.takeover_value() is None
    b.not_started(3, "prepare")
    assert b.takeover_value() == (COMMIT_0, False)  # accepted only: propose it again

    c = Ballots(8, 3, 0.0)
    ballot = c.lead({1, 2}, 0.0)
    c.heard(1, ballot, None, COMMIT_0)
    c.heard(2, ballot, abort(1), None)  # decided at a higher ballot than COMMIT_0
    assert c.takeover_value() == (abort(1), True)


def test_a_takeover_with_nothing_reported_has_no_value_and_one_seen_higher_stands_back() -> None:
    b = Ballots(3, 1, 0.0)
    ballot = b.lead({2}, 0.0)
    b.heard(2, ballot, None, None)
    assert b.takeover_value() == (None, False)
    c = Ballots(3, 1, 0.0)
    c.lead({2}, 0.0)
    c.heard(2, 5, None, None)
    assert c.takeover is None and c.max_ballot == 5
    assert c.lead({2}, 1.0) == 7  # the next ballot of ours above all seen
