"""When speculative decoding pays: a cost governor that keeps drafting only while it is faster than
plain decoding, and an adaptive confidence floor. Both only keep books on (seconds, tokens emitted)
per step; the decoding loop measures the time, so tests can inject any timings.

Governor, per request (reset() at its start):
    probe   alternate drafting and plain steps until each side has PROBE_SAMPLES + 1 samples;
            drop each side's first sample (warm-up: a first call pays for allocation and caches) and
            the worst drafting sample (one unlucky step must not decide); cost = sum(seconds) /
            sum(tokens) per side, a ratio of sums so long steps weigh what they cost.
            Drafting wins iff cost_plain / cost_draft >= WIN_MARGIN.
    draft   after a win, draft for DRAFT_HOLD steps, then probe again.
    park    after a loss, decode plainly for `backoff` steps (16, doubled after each further loss up
            to 64, back to 16 after a win), then probe again.

Confidence floor: a deterministic bandit over FLOORS. Every floor is tried once, then each pull
takes the floor with the lowest cost per emitted token, except every EXPLORE_EVERY-th pull, which
takes the least tried floor. Its statistics persist across requests (they describe the drafter and
the hardware); the governor's verdicts do not (they describe the text being written).
"""
from dataclasses import dataclass

WIN_MARGIN = 1.15
PROBE_SAMPLES = 4
DRAFT_HOLD = 64
BACKOFF_MIN, BACKOFF_MAX = 16, 64
FLOORS = (0.0, 0.15, 0.35, 0.6)
EXPLORE_EVERY = 8


@dataclass(frozen=True)
class Plan:
    draft: bool     # run the drafter this step (else the target decodes the anchor alone)
    p_min: float    # confidence floor for this step's drafts


def cost_per_token(samples):  # [(seconds, tokens)] -> seconds per emitted token
    return sum(s for s, _ in samples) / max(sum(n for _, n in samples), 1)


def without_worst(samples):  # [(seconds, tokens)] -> the same less the slowest per token
    worst = max(range(len(samples)), key=lambda i: samples[i][0] / max(samples[i][1], 1))
    return samples[:worst] + samples[worst + 1:]


def speedup(draft_samples, plain_samples):  # -> cost_plain / cost_draft for one probe round
    draft = without_worst(draft_samples[1:])
    plain = plain_samples[1:]
    return cost_per_token(plain) / max(cost_per_token(draft), 1e-30)


class FloorBandit:
    def __init__(self, floors=FLOORS, explore_every=EXPLORE_EVERY):
        self.floors = tuple(floors)
        self.explore_every = explore_every
        self.seconds = [0.0] * len(self.floors)
        self.tokens = [0] * len(self.floors)
        self.pulls = [0] * len(self.floors)

    def choose(self):  # -> floor for the next drafting step
        n = sum(self.pulls)
        if min(self.pulls) == 0 or n % self.explore_every == self.explore_every - 1:
            return self.floors[self.pulls.index(min(self.pulls))]
        costs = [s / max(t, 1) for s, t in zip(self.seconds, self.tokens)]
        return self.floors[costs.index(min(costs))]

    def record(self, floor, seconds, tokens):
        i = self.floors.index(floor)
        self.seconds[i] += seconds
        self.tokens[i] += tokens
        self.pulls[i] += 1


class CostGovernor:
    def __init__(self, p_min=0.0, floors=None, probe_samples=PROBE_SAMPLES, margin=WIN_MARGIN,
                 hold=DRAFT_HOLD, backoff_min=BACKOFF_MIN, backoff_max=BACKOFF_MAX):
        self.p_min = p_min          # the floor when there is no bandit
        self.floors = floors        # a FloorBandit or None
        self.probe_samples, self.margin, self.hold = probe_samples, margin, hold
        self.backoff_min, self.backoff_max = backoff_min, backoff_max
        self.verdicts = []          # (speedup, drafting won) per finished probe round, this request
        self.reset()

    def reset(self):  # a new request: probe first, shortest back-off
        self.mode = "probe"
        self.samples = {True: [], False: []}
        self.steps_left = 0
        self.backoff = self.backoff_min
        self.verdicts = []

    def plan(self):  # -> Plan for the next step
        draft = self.mode == "draft" or (self.mode == "probe" and
                                         len(self.samples[True]) <= len(self.samples[False]))
        if not draft:
            return Plan(False, self.p_min)
        return Plan(True, self.floors.choose() if self.floors is not None else self.p_min)

    def record(self, plan, seconds, tokens):  # the step `plan` described took `seconds`, emitted `tokens`
        if plan.draft and self.floors is not None:
            self.floors.record(plan.p_min, seconds, tokens)
        if self.mode == "probe":
            self.samples[plan.draft].append((seconds, tokens))
            if min(len(self.samples[True]), len(self.samples[False])) > self.probe_samples:
                self.conclude_probe()
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.mode = "probe"
            self.samples = {True: [], False: []}

    def conclude_probe(self):
        gain = speedup(self.samples[True], self.samples[False])
        won = gain >= self.margin
        self.verdicts.append((gain, won))
        if won:
            self.mode, self.steps_left, self.backoff = "draft", self.hold, self.backoff_min
        else:
            self.mode, self.steps_left = "park", self.backoff
            self.backoff = min(2 * self.backoff, self.backoff_max)
