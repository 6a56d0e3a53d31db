"""The policy (policy.py): how far each round drafts, from the costs and this answer's verdicts."""
import pytest

from specdec_core.policy import DECAY, EXPLORE, GUESS_WEIGHT, MISSES, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, RECENT, Policy
from specdec_core.theory import PassCosts
from specdec_core.trees import Node, verdicts

# a draft forward 0.3 of a step, each row of a pass 0.15 of a step more
LINEAR = PassCosts({1: 1.0, 65: 1.0 + 0.15 * 64}, draft=0.3)


def judged(policy: Policy, rate: float, probability: float = 0.6, rounds: int = 200) -> Policy:
    """`rounds` rounds whose first token, drawn at `probability`, the target accepted at this rate (spread evenly)."""
    for r in range(rounds):
        policy.learn([(1, probability, (r * rate) % 1 + rate >= 1)])
    return policy


def test_the_curve_is_the_expected_tokens_over_the_rounds_cost():
    policy = Policy(LINEAR)
    policy.observe(1.0, 1.0, 2, 2)  # not timed here (no step_ms): the draft's costs stay as given
    a = PRIOR_ACCEPTANCE  # no verdict yet: every depth at the prior
    tokens = [1, 1 + a, 1 + a + a * a]
    assert policy.curve(2) == pytest.approx([tokens[n] / (0.3 * n + 1 + 0.15 * n) for n in range(3)])
    assert policy.plan(2) == (2, policy.curve(2), policy.curve(2)[2])  # no first token seen: the curve's best
    assert Policy(None).plan(8) == (8, [], 0.0)  # costs not measured: as far as asked


def test_drafting_stops_where_acceptance_no_longer_pays_for_the_draft_and_probes_again():
    """At these costs one token pays above an acceptance of 0.45 (1 + a > 1.45); below, rounds are plain steps,
    until enough of them make a probe cheap next to what it may find (EXPLORE)."""
    assert judged(Policy(LINEAR), 0.65).plan(8)[0] == 8  # drafting pays: as far as go_on goes
    low = judged(Policy(LINEAR), 0.3, probability=0.2)
    plans = [low.plan(8) for _ in range(40)]
    n, curve, value = plans[0]
    assert n == 0 and value < 1.0 == curve[0] and max(curve[1:]) < 1.0
    run = next(i for i, plan in enumerate(plans) if plan[0])  # the first probe, then plain steps again
    assert run * EXPLORE >= 1.0 - value > (run - 1) * EXPLORE and plans[run + 1][0] == 0
    assert low.plan(8, reads=False)[0] == 0  # a GPU's chain: the curve's best, which is none


def waits(policy: Policy, plans: int) -> list[int]:
    """The plain steps before each probe in `plans` plans, none of them judged."""
    probes = [i for i in range(plans) if policy.plan(8)[0]]
    return [b - a - 1 for a, b in zip([-1] + probes, probes)]


def test_each_probe_that_drafting_does_not_follow_doubles_the_wait_for_the_next():
    """A probe also feeds the draft every token committed since it last drafted: where drafting still does not pay
    after one, the next waits twice as long, up to MISSES doublings; once drafting pays again, the wait is back to its
    first."""
    low = judged(Policy(LINEAR), 0.3, probability=0.2)
    seen = waits(low, 3000)
    assert len(seen) > MISSES + 2 and seen[0] > 1
    for before, after in zip(seen[:MISSES], seen[1:MISSES + 1]):
        assert abs(after - 2 * before) <= 1
    assert set(seen[MISSES:]) == {seen[MISSES]} and low.misses == MISSES
    judged(low, 0.95, probability=0.95)
    assert low.plan(8)[0] == 8 and low.misses == 0
    judged(low, 0.3, probability=0.2)
    assert waits(low, 3 * seen[0])[0] == seen[0]


def test_verdicts_fade_so_that_the_latest_weigh_most():
    policy = Policy(LINEAR)
    policy.learn([(1, 0.9, True), (2, 0.9, False)])
    policy.learn([])
    assert policy.by_depth.judged[1] == pytest.approx(DECAY)
    first = (DECAY + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (DECAY + PRIOR_WEIGHT)
    # a depth with few verdicts leans on the depth above: one rejection at depth 2, none judged at depth 3
    second = PRIOR_WEIGHT * first / (DECAY + PRIOR_WEIGHT)
    assert policy.forecasts(3) == pytest.approx([first, second, second])
    # a calibrated probability: tokens drafted at 0.9 and accepted half the time are worth about a half
    for r in range(40):
        policy.learn([(1, 0.9, r % 2 == 0)])
    assert policy.worth(0.9) == pytest.approx(0.5, abs=0.05) and policy.worth(0.2) == pytest.approx(0.15)
    assert list(policy.firsts)[-3:] == [0.9] * 3


def test_the_chain_goes_on_while_its_next_token_raises_tokens_per_unit_time():
    policy = Policy(LINEAR)
    # after one token worth 0.9, the next accepted at 0.8: 1.9 / 1.45 = 1.31 now, (1.9 + 0.72) / 1.9 = 1.38 with it
    assert policy.go_on([0.9], 0.8)
    # after one worth 0.3: 1.3 / 1.45 = 0.90 now, (1.3 + 0.24) / 1.9 = 0.81 with one more
    assert not policy.go_on([0.3], 0.8)
    assert policy.gain([0.9]) == pytest.approx(1.9 / 1.45)
    # a next token that came with a guess costs only its row: (1.3 + 0.24) / 1.6 = 0.96 > 0.90
    assert policy.go_on([0.3], 0.8, guessed=True)


def test_the_next_token_is_forecast_by_what_followed_tokens_of_like_probability():
    """A draft sure of a token is often sure of the next: here the tokens after one drawn at 0.97 are all accepted,
    those after one drawn at 0.6 half of the time, and the depth alone (at 0.75) cannot tell the two apart."""
    policy = Policy(LINEAR)
    for r in range(60):
        policy.learn([(1, 0.97, True), (2, 0.6, True), (3, 0.97, r % 2 == 0)])
        policy.learn([(1, 0.6, True), (2, 0.97, r % 2 == 0)])
    rates = policy.forecasts(3)
    assert policy.next_rate(0.97, 2) > 0.95 and policy.next_rate(0.6, 2) < 0.55
    assert policy.next_rate(0.6, 3) < rates[2] < policy.next_rate(0.97, 3)
    assert policy.next_rate(0.3, 2) == pytest.approx(rates[1])  # none judged after such a token: the depth's
    # a first child rejected at the depth above (a sibling taken in its place) leaves no verdict after it
    before = dict(policy.after.judged)
    policy.learn([(1, 0.1, False), (2, 0.9, True)])
    assert all(policy.after.judged[key] == pytest.approx(DECAY * count) for key, count in before.items())
    assert not policy.after.judged[0]


def test_the_draft_costs_are_the_fastest_its_latest_rounds_measure():
    """Where the target's step was timed (20 ms here), the draft's costs are the fastest of its latest rounds' times,
    the costs timed at load among them until RECENT rounds have come."""
    policy = Policy(PassCosts(LINEAR.sizes, draft=0.3, step_ms=20.0))
    policy.observe(0.004, 0.010, 3, 5)  # first token 4 ms (0.2 of a step), two more forwards of 5 ms, 2 guessed
    assert policy.first == pytest.approx(0.2) and policy.next == pytest.approx(0.25)
    assert policy.guessing == pytest.approx(GUESS_WEIGHT * 0.5)
    assert policy.cost(3) == pytest.approx(policy.first + 2 * policy.next * (1 - policy.guessing) + 1.0 + 0.15 * 3)
    policy.observe(0.030, 0.040, 2, 2)  # slower: nothing moves
    assert policy.first == pytest.approx(0.2) and policy.next == pytest.approx(0.25)
    for _ in range(RECENT - 1):
        policy.observe(0.016, 0.036, 3, 3)
    assert policy.first == pytest.approx(0.8) and policy.next == pytest.approx(0.9)  # 4 and 5 ms: RECENT rounds old


def test_bursts_of_other_work_on_some_rounds_do_not_price_the_draft_out():
    """A browser drawing each update shares the cores with the round after it, so some rounds take several times
    their cost. Contention only adds time: the costs are the fastest of the latest rounds, and rounds slowed by a
    burst move them not at all, where an average would price drafting out and then, drafting no more, never see it
    cheap again."""
    policy = Policy(PassCosts(LINEAR.sizes, draft=0.3, step_ms=20.0))
    for r in range(40):
        burst = 0.060 if r % 2 else 0.0  # every other round's draft, every third round's pass
        policy.observe(0.006 + burst, 0.012 + burst, 3, 3)  # first token 6 ms (0.3 of a step), two forwards of 6 ms
        policy.passed(0.020 * policy.verify[4] + (burst if r % 3 == 0 else 0.0), 4)
        policy.learn([(1, 0.9, True), (2, 0.9, True), (3, 0.9, True)])
    assert policy.step_s == pytest.approx(0.020)
    assert policy.first == pytest.approx(0.3) and policy.next == pytest.approx(0.3)
    assert policy.plan(4)[0] == 4


def test_the_targets_step_follows_what_its_steps_and_two_token_passes_take():
    """A shared machine's speed changes: the step the draft's times are measured against is the fastest of the
    target's latest plain steps and passes of two tokens (either reads the weights once), and larger passes cost what
    the latest of them took against their timed cost, so a machine now twice as slow for both models leaves every cost
    in steps where it was, once RECENT rounds of each kind have come."""
    policy = Policy(PassCosts(LINEAR.sizes, draft=0.3, step_ms=20.0))
    policy.observe(0.006, 0.012, 3, 3)  # a draft forward 6 ms: 0.3 of a 20 ms step
    timed = list(policy.verify)
    steps = 0  # passes that said what a step takes
    for r in range(3 * RECENT):
        rows = (1, 2, 5)[r % 3]  # a plain step, or a pass of 2 (1.15 steps here) or 5 rows (1.6)
        policy.passed(0.040 * timed[rows], rows)  # the machine now twice as slow for both
        steps += rows <= 2
        assert policy.step_s == pytest.approx(0.020 if steps < RECENT else 0.040)
        policy.observe(0.012, 0.024, 3, 3)
    assert policy.first == pytest.approx(0.3) and policy.next == pytest.approx(0.3)
    assert policy.verify == pytest.approx(timed)
    untimed = Policy(LINEAR)  # no step timed: nothing to follow
    untimed.passed(0.040, 1)
    assert untimed.step_s == 0


def test_larger_passes_cost_what_the_rounds_take():
    """A step reads every weight once; a pass of more than two tokens also shows its arithmetic. Other work on the
    machine slows the two apart, and a pass's rows may cost more in a round than they did timed alone: the policy
    prices each as the latest rounds took them, never a larger pass below two tokens', and drafts shorter chains
    where rows cost more."""
    policy = judged(Policy(PassCosts(LINEAR.sizes, draft=0.3, step_ms=20.0)), 0.8, probability=0.9)
    for _ in range(RECENT):
        policy.passed(0.030, 1)  # plain steps slowed by half (their reading shared), passes of 9 rows as timed
        policy.passed(0.020 * 2.2, 9)
    assert policy.step_s == pytest.approx(0.030)
    assert policy.verify[9] == pytest.approx(2.2 / 1.5) and policy.verify[2] == pytest.approx(1.15)
    assert policy.verify[5] == pytest.approx(1.15)  # 1.6 / 1.5 is less than a pass of two tokens costs
    cheap = policy.curve(8)
    for _ in range(RECENT):
        policy.passed(0.030 * 2.2 * 2, 9)  # now each pass of 9 rows twice what its timing says, in steps
    assert policy.verify[9] == pytest.approx(4.4) and policy.verify[3] == pytest.approx(2.6)
    assert policy.cost(2) == pytest.approx(policy.first + policy.next + 2.6)
    dear = policy.curve(8)
    best = lambda curve: max(range(len(curve)), key=curve.__getitem__)
    assert best(dear) < best(cheap) and max(dear) < max(cheap)


def test_a_rounds_verdicts_are_read_from_the_tokens_it_committed():
    """A tree: the root's children 5 (first) and 6; 5's child 7. The target took 6 (so 5 was rejected), then its own."""
    node = lambda token, parent, prob, sibling: Node(token, parent, prob, 0, sibling, sibling == 0, prob, prob)
    nodes = [node(5, -1, 0.7, 0), node(6, -1, 0.2, 1), node(7, 0, 0.9, 0)]
    assert verdicts(10, nodes, [0] * 10 + [6, 3]) == [(1, 0.7, False)]  # 6 was judged after 5: not counted
    assert verdicts(10, nodes, [0] * 10 + [5, 7, 1]) == [(1, 0.7, True), (2, 0.9, True)]
    assert verdicts(10, nodes, [0] * 10 + [5, 2]) == [(1, 0.7, True), (2, 0.9, False)]
    assert verdicts(10, [], [0] * 10 + [4]) == []  # a plain step
