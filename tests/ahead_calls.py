"""What a rollout schedule asks of its phase besides rollouts (trainer/rollouts/rollout_phase.py `RolloutPhase`): that
its extra sources sample ahead, and to drain or drop what they sampled ahead. The schedule tests' phases have no extra
sources; they record these calls."""


class RecordsAheadCalls:
    """A rollout phase's `sample_ahead` / `drain_ahead` / `drop_ahead`, recorded in order in `ahead_calls`
    (`("sample_ahead", group, depth)`, `"drain_ahead"`, `"drop_ahead"`)."""

    def sample_ahead(self, group, depth: int) -> None:
        self._record(("sample_ahead", group, depth))

    def drain_ahead(self) -> None:
        self._record("drain_ahead")

    def drop_ahead(self) -> None:
        self._record("drop_ahead")

    def _record(self, call) -> None:
        self.__dict__.setdefault("ahead_calls", []).append(call)
